"""The daemon's dashboard in headless Chromium, and pausing contribution through the
control API: real node processes (tiny model), a real browser running the page's
script against the node."""

import json
import re
import shutil
import subprocess
import time
import urllib.request

import pytest
import trio

from compushare.app.api.auth import TOKEN_FILE
from compushare.errors import RouteError
from compushare.model.catalog import import_path
from compushare.pipeline.client.consumer import Consumer, RunRequest
from compushare.pipeline.client.sampling import SamplingParams

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _control(state: dict, data_dir, path: str, method: str = "GET") -> dict:
    token = (data_dir / TOKEN_FILE).read_text().strip()
    request = urllib.request.Request(f"{state['api']}{path}", method=method,
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _dump_dom(url: str, profile) -> str:
    out = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=8000",
                          "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="`make test` installs chromium (Debian package)")
async def test_dashboard_in_headless_chromium_and_pause_resume(processes, tiny_model, tmp_path):
    ads = ["--ad-period", "1", "--api-port", "0"]
    _, a = processes.node("a", tiny_model, "0:2", extra=ads)
    boot = a["addrs"][:1]
    _, b = processes.node("b", tiny_model, "2:4", bootstrap=boot, extra=ads)
    a_dir, b_dir = processes.root / "a", processes.root / "b"
    client_dir = tmp_path / "client"
    import_path(tiny_model, client_dir, alias="tiny")
    request = RunRequest(model="tiny", prompt=[1, 17, 42, 99], params=SamplingParams(max_new_tokens=12,
                                                                                      stop_at_eos=False))
    async with Consumer.connect(client_dir, tuple(boot), "tiny", text_prompts=False) as consumer:
        with trio.fail_after(60):
            await consumer.generate(request)
        status = _control(a, a_dir, "/control/status")
        assert status["tokens_served"] > 0 and status["throughput"] > 0 and status["state"] == "serving"

        # What a person opening the dashboard sees, once the page's script has run.
        with trio.fail_after(30):
            while True:  # both ads known to a (offering private sessions: nodes do by default), b's karma checked
                board = _control(a, a_dir, "/control/dashboard")
                if len(board["peers"]) >= 2 and all(p["karma"] is not None and p["private"] for p in board["peers"]):
                    break
                await trio.sleep(1)
        token = (a_dir / TOKEN_FILE).read_text().strip()
        dom = await trio.to_thread.run_sync(_dump_dom, f"{a['api']}/dashboard#token={token}", tmp_path / "chrome")
        assert f'<span id="peer">{a["peer_id"]}</span>' in dom
        assert '<td id="state">serving</td>' in dom
        served = int(re.search(r'<td id="tokens">(\d+)</td>', dom).group(1))
        assert served >= status["tokens_served"]
        assert re.search(r'<td id="karma">\d+\.\d{3} \(\d+ receipts', dom)
        assert re.search(r'<td id="throughput">[\d.]+ tokens/s</td>', dom)
        cells = re.findall(r'<div class="cell c(\d)"[^>]*>(\d+)</div>', dom)
        assert [int(count) for _, count in cells] == [1, 1, 1, 1]  # tiny model: 4 blocks, one server each
        rows = re.findall(r'<tr class="peer-row"><td>(\w+)</td><td>([\d.?]+)</td><td>(\d+:\d+)</td>', dom)
        assert {(peer, span) for peer, _, span in rows} == {(a["peer_id"], "0:2"), (b["peer_id"], "2:4")}
        assert '<p id="error"></p>' in dom
        assert '<td id="private">served: 0 sessions, 0 encrypted requests, 0.0 s of HE compute, 0 refused</td>' in dom
        assert re.findall(r'<td class="private">(\w+)</td>', dom) == ["yes", "yes"]  # each peer's ad offers them
        wrong = await trio.to_thread.run_sync(_dump_dom, f"{a['api']}/dashboard#token=wrong", tmp_path / "chrome2")
        assert '<p id="error">cannot reach the node: missing or wrong API key' in wrong

        # Pausing b: it takes no new sessions (open ones would go on), its ad says so,
        # and a consumer finds no route through blocks 2:4 until it resumes.
        assert _control(b, b_dir, "/control/pause", "POST") == {"changed": True, "state": "paused"}
        with trio.fail_after(30):
            while True:
                board = _control(a, a_dir, "/control/dashboard")
                states = {p["peer_id"]: p["serving"][0]["state"] for p in board["peers"] if p["serving"]}
                if states.get(b["peer_id"]) == "paused":
                    break
                await trio.sleep(0.5)
        with pytest.raises(RouteError):
            with trio.fail_after(60):
                await consumer.generate(request)
        assert _control(b, b_dir, "/control/resume", "POST") == {"changed": True, "state": "serving"}
        began = time.monotonic()
        with trio.fail_after(60):
            outcome = await consumer.generate(request)
        assert len(outcome.tokens) == 12 and time.monotonic() - began < 60
