"""The tray icon on a real X server (Xvfb) with a real tray host (trayer): a
screenshot shows the icon in the node's state colour, green while contributing,
amber once paused through the control API. `make test` installs xvfb and trayer."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from compushare.app.api.auth import TOKEN_FILE
from compushare.app.tray import COLOURS, describe

NEEDED = [shutil.which(tool) for tool in ("Xvfb", "trayer")] + [importlib.util.find_spec("pystray")]


def test_tray_description_of_states():
    assert describe(None)[0] == "error"
    state, title = describe({"state": "paused", "start": 0, "end": 2, "karma": {"score": 2.5}, "tokens_served": 7})
    assert state == "paused" and "karma 2.50" in title and "7 tokens" in title
    assert describe({"state": "serving"})[0] == "contributing"


def _free_display() -> int:
    for number in range(90, 140):
        if not os.path.exists(f"/tmp/.X11-unix/X{number}") and not os.path.exists(f"/tmp/.X{number}-lock"):
            return number
    raise RuntimeError("no free X display number")


def _pixels(display: str, colour: tuple[int, int, int]) -> int:
    from PIL import ImageGrab

    shot = ImageGrab.grab(xdisplay=display).convert("RGB")
    return sum(1 for pixel in shot.getdata() if all(abs(a - b) <= 8 for a, b in zip(pixel, colour)))


def _wait_for_tray_host(display: str, timeout: float = 60.0) -> None:
    """Until the tray host owns the XEmbed tray selection (where pystray docks)."""
    from Xlib import X
    from Xlib.display import Display

    connection = Display(display)
    try:
        selection = connection.intern_atom(f"_NET_SYSTEM_TRAY_S{connection.get_default_screen()}")
        deadline = time.monotonic() + timeout
        while connection.get_selection_owner(selection) == X.NONE:
            assert time.monotonic() < deadline, f"trayer did not take the tray selection within {timeout:.0f} s"
            time.sleep(0.1)
    finally:
        connection.close()


def _wait_for_pixels(display: str, colour, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        count = _pixels(display, colour)
        if count >= 100:
            return count
        time.sleep(0.5)
    return _pixels(display, colour)


@pytest.mark.skipif(None in NEEDED, reason="`make test` installs xvfb, trayer (Debian) and the [tray] extra")
def test_tray_icon_shows_state_under_xvfb_with_a_tray_host(processes, tiny_model, tmp_path):
    _, node = processes.node("a", tiny_model, "0:4", extra=["--api-port", "0", "--ad-period", "1"])
    data_dir = processes.root / "a"
    display = f":{_free_display()}"
    env = dict(os.environ, DISPLAY=display, PYSTRAY_BACKEND="xorg")
    started: list[subprocess.Popen] = []
    try:
        started.append(subprocess.Popen(["Xvfb", display, "-screen", "0", "800x200x24", "-nolisten", "tcp"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        while not os.path.exists(f"/tmp/.X11-unix/X{display[1:]}") and time.monotonic() < deadline:
            time.sleep(0.1)
        started.append(subprocess.Popen(["trayer", "--edge", "top", "--align", "right", "--widthtype", "request",
                                         "--height", "48", "--SetDockType", "true", "--transparent", "false"],
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_for_tray_host(display)
        assert _pixels(display, COLOURS["contributing"]) == 0  # nothing green before the icon
        tray_log = tmp_path / "tray.log"
        with tray_log.open("wb") as sink:  # a file, not a pipe nobody reads (pystray logs each failed dock)
            started.append(subprocess.Popen([sys.executable, "-m", "compushare", "tray", "--data-dir", str(data_dir)],
                                            env=env, stdout=sink, stderr=subprocess.STDOUT))
        green = _wait_for_pixels(display, COLOURS["contributing"])
        assert green >= 100, (f"no green tray icon on the screen ({green} pixels; "
                              f"{_pixels(display, COLOURS['error'])} red); the tray said:\n"
                              f"{tray_log.read_text(errors='replace')[-3000:]}")

        token = (data_dir / TOKEN_FILE).read_text().strip()
        request = urllib.request.Request(f"{node['api']}/control/pause", method="POST",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read())["state"] == "paused"
        amber = _wait_for_pixels(display, COLOURS["paused"])
        assert amber >= 100, f"the icon did not turn amber ({amber} pixels)"
        assert started[-1].poll() is None  # the tray is still running
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
