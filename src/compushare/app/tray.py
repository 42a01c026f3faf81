"""`compushare tray`: a system-tray icon for the node running on a data dir.

It talks to the node only through its control API (token from the data dir): the
icon's colour says contributing (green), paused (amber) or error (red: no node,
or it does not answer); its title adds karma and tokens served. Menu: pause /
resume contributing, open the dashboard, quit (stops the node, then the icon).
pystray is an optional extra (`pip install compushare[tray]`); on Linux it needs
an X tray host (any XEmbed system tray, e.g. trayer or a desktop panel).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import webbrowser
from pathlib import Path

from .api.auth import load_or_create_token
from .api.client import call
from ..config import STATE_FILE
from ..errors import UsageError
from .swarm import stop_node

log = logging.getLogger(__name__)

POLL_S = 2.0
SIZE = 64
COLOURS = {"contributing": (46, 184, 77), "paused": (240, 170, 20), "error": (215, 48, 39)}


def icon_image(state: str):
    """A filled circle in the state's colour (one unmistakable pixel colour: tests look for it)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGBA", (SIZE, SIZE), (0, 0, 0, 0))
    ImageDraw.Draw(image).ellipse((4, 4, SIZE - 4, SIZE - 4), fill=COLOURS[state] + (255,))
    return image


def describe(status: dict | None) -> tuple[str, str]:
    """(state, title) for the icon from the control API's status (None: unreachable). Pure."""
    if status is None:
        return "error", "CompuShare: no node answers on this data dir"
    state = "paused" if status.get("state") == "paused" else "contributing"
    karma = status.get("karma", {}).get("score", 1.0)
    return state, (f"CompuShare: {state}, blocks {status.get('start')}:{status.get('end')}, karma {karma:.2f}, "
                   f"{status.get('tokens_served', 0)} tokens served")


class Tray:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.status: dict | None = None
        self._stop = threading.Event()

    def _api(self) -> str | None:
        try:
            return json.loads((self.data_dir / STATE_FILE).read_text()).get("api")
        except (OSError, ValueError):
            return None

    def _call(self, path: str, method: str = "GET") -> dict:
        api = self._api()
        if not api:
            raise OSError("no node with an API runs on this data dir")
        return call(self.data_dir, api, path, method)

    def _dashboard_launcher(self, api: str) -> Path:
        """A 0600 page in the data dir that forwards to the dashboard with the token: a
        browser's command line (readable by every local user) then never holds it."""
        path = self.data_dir / "dashboard.html"
        url = json.dumps(f"{api}/dashboard#token={load_or_create_token(self.data_dir)}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"<!doctype html><meta charset=utf-8><script>location.replace({url})</script>\n")
        return path

    def poll(self) -> None:
        try:
            self.status = self._call("/control/status")
        except (OSError, ValueError) as exc:
            log.debug("node status unavailable: %s", exc)
            self.status = None

    def run(self) -> None:
        try:
            import pystray
        except ImportError:
            raise UsageError("the tray icon needs pystray: pip install 'compushare[tray]'") from None

        def toggle(icon, _item) -> None:
            paused = self.status is not None and self.status.get("state") == "paused"
            try:
                self._call("/control/resume" if paused else "/control/pause", "POST")
            except OSError as exc:
                log.warning("could not reach the node: %s", exc)
            refresh(icon)

        def dashboard(_icon, _item) -> None:
            api = self._api()
            if api:
                webbrowser.open(self._dashboard_launcher(api).as_uri())

        def quit_all(icon, _item) -> None:
            with contextlib.suppress(UsageError):  # already gone
                stop_node(self.data_dir)
            self._stop.set()
            icon.stop()

        def refresh(icon) -> None:
            self.poll()
            state, title = describe(self.status)
            icon.icon, icon.title = icon_image(state), title
            icon.update_menu()

        menu = pystray.Menu(
            pystray.MenuItem(lambda _item: "Resume contributing" if (self.status or {}).get("state") == "paused"
                             else "Pause contributing", toggle, enabled=lambda _item: self.status is not None),
            pystray.MenuItem("Open dashboard", dashboard, enabled=lambda _item: self.status is not None),
            pystray.MenuItem("Quit (stop the node)", quit_all),
        )
        self.poll()
        state, title = describe(self.status)
        icon = pystray.Icon("compushare", icon_image(state), title, menu)

        def setup(icon) -> None:
            icon.visible = True
            while not self._stop.wait(POLL_S):
                refresh(icon)

        icon.run(setup=setup)
