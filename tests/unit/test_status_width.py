"""`compushare status` on a narrow terminal: at 80 columns (and 120) a realistic swarm,
with long peer ids, GPU names, several spans per peer and two models, renders with no
line past the width, no word cut to an ellipsis, and every header word whole."""

from __future__ import annotations

import io

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from rich.console import Console

from compushare.app.status import peers_table, ready_line, render, spans_table, summarize
from compushare.hardware import Hardware
from compushare.net.ads import Serving, make_ad
from compushare.net.view import SwarmView

pytestmark = pytest.mark.unit

NOW = 1_700_000_000.0
SMOL, TINY = "ab" * 32, "cd" * 32
HARDWARE = [
    Hardware(cpu_cores=16, ram_mb=257_000, ram_free_mb=200_000, gpu="NVIDIA GeForce RTX 4090", gpu_mb=24_564),
    Hardware(cpu_cores=64, ram_mb=1_031_000, ram_free_mb=900_000, gpu="NVIDIA A100-SXM4-80GB", gpu_mb=81_920),
    Hardware(cpu_cores=2, ram_mb=8192, ram_free_mb=4096, gpu=None, gpu_mb=0),
    Hardware(cpu_cores=8, ram_mb=32_768, ram_free_mb=16_000, gpu="NVIDIA H100 80GB HBM3", gpu_mb=81_559),
]
DAEMON = {"karma": {"score": 1.234, "receipts": 1520, "compute_ms": 981_000}, "tokens_served": 123_456,
          "api": "http://127.0.0.1:8311",
          "private": {"sessions": 3, "requests": 120, "refused": {"keys": 1}, "compute_s": 12.3,
                      "worker_restarts": 0, "held_mb": 48.2},
          "net": {"reachability": "private", "relays": ["/ip4/1.2.3.4/tcp/4001/p2p/x"] * 2, "relay_offered": False},
          "memory": {"device": "cuda", "blocks": 30, "format": "q4/g32", "weights_mb": 120.0, "kv_mb": 300.0,
                     "kv_tokens": 65_536, "private_mb": 0.0, "budget_mb": 24_000}}


def _ad(seed: int, hardware: Hardware, serving: list[Serving], reach: str, relay: bool):
    key_pair = create_new_key_pair(bytes([seed]) * 32)
    peer = ID.from_pubkey(key_pair.public_key).to_base58()
    return make_ad(key_pair, peer, ["/ip4/10.0.0.1/tcp/4001"], hardware, serving, "0.1.0", now=NOW,
                   reach=reach, relay=relay)


def realistic_status(tmp_path) -> dict:
    view = SwarmView(policy=False)
    spans = [
        [Serving(SMOL, 0, 15, "float32", 131_072, 0.93, 1234.0, private_rate=2.0, fmt="q4/g32"),
         Serving(TINY, 0, 11, "bfloat16", 8192, 0.05, 87.0, fmt="bf16")],
        [Serving(SMOL, 15, 30, "float32", 65_536, 1.0, 9876.0, state="loading", fmt="q4/g32")],
        [Serving(TINY, 11, 22, "bfloat16", 4096, 0.5, 12.0, fmt="gguf")],
        [Serving(SMOL, 0, 30, "float32", 262_144, 0.0, 15000.0, private_rate=1.0, fmt="q4/g32")],
    ]
    reach = [("public", True), ("private", False), ("unknown", False), ("public", False)]
    for seed, (hardware, serving, (where, relay)) in enumerate(zip(HARDWARE, spans, reach), start=1):
        assert view.offer(_ad(seed, hardware, serving, where, relay), NOW - seed * 3.3).accepted
    status = summarize(view, tmp_path, {"start": 0, "end": 15, "state": "serving", "placement": "automatic"},
                       now=NOW, asked=4)
    status["this_node"]["daemon"] = DAEMON
    for index, peer in enumerate(status["peers"]):
        peer["karma"] = None if index == 2 else 1.0 + index / 3
    return status


def _render(status: dict, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    render(status, console)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 120])
def test_status_fits_the_terminal_with_every_word_whole(tmp_path, width):
    status = realistic_status(tmp_path)
    assert len(status["peers"]) == 4 and len(status["models"]) == 2
    text = _render(status, width)
    lines = text.splitlines()
    assert max(map(len, lines)) <= width, "\n".join(line for line in lines if len(line) > width)
    assert "…" not in text and "..." not in text
    words = text.split()
    for table in (peers_table(status), spans_table(status)):
        for column in table.columns:
            for word in str(column.header).split():
                assert word in words, (word, width)
    for peer in status["peers"]:
        assert peer["peer_id"][-12:] in words  # the peer column is never cut
        assert f"{peer['hardware']['cpu']} cpu" in text
    for gpu in ("NVIDIA", "GeForce", "RTX", "4090", "A100-SXM4-80GB", "HBM3"):
        assert gpu in words
    for span in ("0:15", "15:30", "0:11", "11:22", "0:30", "q4/g32", "bf16", "gguf", "loading", "serving"):
        assert span in words
    assert "this node: consumer, provider of blocks 0:15 (serving, automatic placement)" in " ".join(words)
    assert "coverage of abababababab" in text and "coverage of cdcdcdcdcdcd" in text


def test_at_120_columns_each_peer_is_one_line(tmp_path):
    status = realistic_status(tmp_path)
    lines = _render(status, 120).splitlines()
    for peer in status["peers"]:
        rows = [line for line in lines if peer["peer_id"][-12:] in line]
        assert len(rows) == 1 + len(peer["serving"])  # its line of peers, a line per span
        spans = [line for line in lines if "│" in line and any(s["model"][:8] in line for s in peer["serving"])]
        assert spans


def test_ready_line_says_what_the_node_serves_and_where():
    state = {"model_id": SMOL, "model_name": "smollm2-135m", "start": 0, "end": 15, "num_blocks": 30,
             "format": "q4/g32", "api": "http://127.0.0.1:8311", "peer_id": "12D3KooWxyz"}
    assert ready_line(state) == (
        f"ready: serving smollm2-135m ({SMOL[:12]}) blocks 0:15 of 30 in q4/g32; API http://127.0.0.1:8311 "
        "(dashboard http://127.0.0.1:8311/dashboard, chat http://127.0.0.1:8311/chat; token in the data dir); "
        "peer 12D3KooWxyz")
    assert "API off" in ready_line(dict(state, api=None, model_name=SMOL))
    assert f"serving {SMOL[:12]} blocks" in ready_line(dict(state, model_name=SMOL))
