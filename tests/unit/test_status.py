"""`compushare status`'s summary and its text, from a view of signed ads (no swarm):
which peers serve private sessions, and this node's private figures."""

import io

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from rich.console import Console

from compushare.app.status import private_line, render, summarize
from compushare.hardware import Hardware
from compushare.net.ads import Serving, make_ad
from compushare.net.view import SwarmView

MODEL = "ab" * 32
NOW = 1_700_000_000.0
HW = Hardware(cpu_cores=2, ram_mb=8192, ram_free_mb=4096, gpu=None, gpu_mb=0)
PRIVATE_STATS = {"sessions": 3, "requests": 120, "refused": {"keys": 1, "span": 1}, "compute_s": 12.34,
                 "worker_restarts": 0, "held_mb": 48.2}


def _ad(seed: int, start: int, end: int, private_rate: float):
    key_pair = create_new_key_pair(bytes([seed]) * 32)
    peer = ID.from_pubkey(key_pair.public_key).to_base58()
    serving = Serving(MODEL, start, end, "float32", free_tokens=4096, load=0.1, block_rate=50.0,
                      private_rate=private_rate)
    return make_ad(key_pair, peer, ["/ip4/127.0.0.1/tcp/4001"], HW, [serving], "0.1.0", now=NOW)


def _status(tmp_path):
    view = SwarmView(policy=False)
    ads = [_ad(1, 0, 2, 1.5), _ad(2, 2, 4, 0.0)]
    for ad in ads:
        assert view.offer(ad, NOW).accepted
    status = summarize(view, tmp_path, None, now=NOW, asked=2)
    return status, ads


def test_summary_says_which_peers_serve_private_sessions(tmp_path):
    status, (private, plain) = _status(tmp_path)
    by_peer = {p["peer_id"]: p for p in status["peers"]}
    assert by_peer[private.peer_id]["private"] is True and by_peer[private.peer_id]["serving"][0]["priv"] == 1.5
    assert by_peer[plain.peer_id]["private"] is False


def _render(status) -> str:
    console = Console(file=io.StringIO(), width=240, color_system=None)
    render(status, console)
    return console.file.getvalue()


def test_status_text_shows_private_peers_and_this_nodes_private_sessions(tmp_path):
    status, (private, plain) = _status(tmp_path)
    status["this_node"]["daemon"] = {"karma": {"score": 1.0}, "tokens_served": 5, "api": "http://x",
                                     "private": PRIVATE_STATS}
    text = _render(status)
    assert ("private sessions: served (3 so far, 120 encrypted requests), 12.3 s of HE compute, 2 refused, "
            "0 worker restarts, 48.2 MB held") in text
    header = next(line for line in text.splitlines() if "peer" in line and "serves" in line)
    assert "private" in header
    rows = {line.split()[1]: line for line in text.splitlines() if private.peer_id[-12:] in line
            or plain.peer_id[-12:] in line}
    assert " yes " in rows[private.peer_id[-12:]] and " no " in rows[plain.peer_id[-12:]]
    assert private_line(None) == "private sessions: not served (node --no-private)"
    status["this_node"]["daemon"]["private"] = None
    assert "private sessions: not served" in _render(status)
