"""Model distribution over /compushare/pieces/1.0.0 between real libp2p hosts (issue 4):
a node with nothing fetches its span from three seeders and serves it; a hostile
seeder is banned; a download killed with SIGKILL resumes with only what is missing."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from compushare.model.catalog import import_path
from compushare.model.store import ModelStore
from compushare.net.dial import peer_info
from compushare.net.host import open_host
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
from compushare.torrent.fetch import Bans, fetch_model
from compushare.torrent.protocol import PIECES_PROTOCOL
from compushare.torrent.seeder import Seeder
from compushare.torrent.storage import Library, ModelPieces, part_path
from helpers import reference_greedy

PROMPT = [1, 17, 42, 99, 3]


def model_id_of(tiny_model: Path, data_dir: Path) -> str:
    return import_path(tiny_model, data_dir, alias="tiny").model_id


def assert_verified(model) -> None:
    """Every file of `model` held here matches the manifest, piece by piece."""
    manifest = model.manifest
    for f in model.held_files():
        data = (model.path / manifest.files[f].name).read_bytes()
        for i in manifest.file_pieces(f):
            piece = manifest.pieces[i]
            assert hashlib.sha256(data[piece.offset:piece.offset + piece.length]).hexdigest() == piece.sha256


async def test_a_node_with_nothing_fetches_its_span_from_three_seeders_and_serves_it(processes, tiny_model,
                                                                                    tmp_path):
    _, a = processes.node("a", tiny_model, "0:1")
    boot = a["addrs"][:1]
    _, b = processes.node("b", tiny_model, "3:4", bootstrap=boot)
    _, c = processes.seeder("c", tiny_model, bootstrap=boot)  # seeds only: found through the DHT alone
    model_id = ModelStore(processes.root / "a").get("tiny").model_id

    _, d = processes.node("d", None, "1:3", alias=model_id, bootstrap=boot)

    fetched = d["fetched"]
    assert len(fetched) == 1 and fetched[0]["blocks"] == [1, 3] and fetched[0]["banned"] == []
    shares = fetched[0]["bytes_from"]
    assert set(shares) == {a["peer_id"], b["peer_id"], c["peer_id"]}, shares
    assert all(count > 0 for count in shares.values())
    held = ModelStore(processes.root / "d").get(model_id)
    assert held.held_blocks() == [1, 2] and not held.holds(head=True)  # its span, nothing else
    assert_verified(held)
    span_tensors = [t for f in held.manifest.files if f.block in (1, 2) for t in f.tensors.values()]
    assert d["parameters"] == sum(math.prod(t.shape) for t in span_tensors)  # loaded what it fetched

    # The consumer holds nothing either: it fetches the head (and tokenizer files)
    # from the seeders, then generates through the chain.
    client = tmp_path / "client"
    outcome = await run_prompt(client, tuple(boot), RunRequest(
        model=model_id, prompt=PROMPT, params=SamplingParams(max_new_tokens=16, stop_at_eos=False)))
    assert outcome.tokens == reference_greedy(tiny_model, PROMPT, 16)
    fetched_by_client = ModelStore(client).get(model_id)
    assert fetched_by_client.holds(head=True) and fetched_by_client.held_blocks() == []
    assert [(h.peer_id, h.start, h.end) for h in outcome.route] == [
        (a["peer_id"], 0, 1), (d["peer_id"], 1, 3), (b["peer_id"], 3, 4)]


class CorruptPieces(ModelPieces):
    """Holds the real model but flips a byte in every piece it sends."""

    @staticmethod
    def _corrupt(data) -> bytes:
        data = bytearray(data)
        data[len(data) // 2] ^= 0xFF
        return bytes(data)

    def read(self, index: int) -> bytes:
        return self._corrupt(super().read(index))

    def read_cached(self, index: int, headroom: int = 0):
        data = super().read_cached(index, headroom)
        if data is not None:
            data[headroom + (len(data) - headroom) // 2] ^= 0xFF
        return data


class HostileLibrary(Library):
    def pieces(self, model_id: str):
        model = self.models.get(model_id)
        return CorruptPieces(model) if model else None


def _info(host) -> PeerInfo:
    return PeerInfo(host.get_id(), host.get_addrs())


async def test_a_hostile_seeder_is_banned_and_the_download_completes_from_honest_ones(processes, tiny_model,
                                                                                       tmp_path):
    honest = [processes.seeder(name, tiny_model)[1] for name in ("h1", "h2")]
    hostile_dir = tmp_path / "hostile"
    model_id = model_id_of(tiny_model, hostile_dir)
    downloader = Library(tmp_path / "downloader")
    bans = Bans()

    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as hostile, \
            open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as host:
        hostile.set_stream_handler(PIECES_PROTOCOL, Seeder(HostileLibrary(hostile_dir)).handle)
        seeders = [_info(hostile)] + [peer_info(s["peer_id"], s["addrs"]) for s in honest]

        async def discover():
            return seeders

        with trio.fail_after(60):
            result = await fetch_model(host, downloader, model_id, discover, everything=True, bans=bans)

    bad = hostile.get_id().to_string()
    assert result.banned == [bad] and bad in bans
    assert bad not in result.bytes_from
    assert set(result.bytes_from) == {s["peer_id"] for s in honest}
    model = downloader.models.get(model_id)
    assert model.holds(blocks=(0, model.num_blocks), head=True)
    assert_verified(model)
    assert result.pieces == len(model.manifest.pieces)


def _fetch_cmd(data_dir: Path, model_id: str, boot: str) -> list[str]:
    return [sys.executable, "-m", "compushare", "models", "fetch", model_id, "--data-dir", str(data_dir),
            "--bootstrap", boot, "--json"]


def _held_pieces(data_dir: Path, model_id: str) -> set[int]:
    """What a (possibly running) download has verified so far, read from its files."""
    model = ModelStore(data_dir).get(model_id) if (data_dir / "models").exists() else None
    return ModelPieces(model).have if model is not None else set()


def test_kill_9_during_a_download_leaves_nothing_corrupt_and_the_restart_fetches_only_what_is_missing(
        processes, tiny_model, tmp_path):
    # Two seeders limited to 40 KB/s each: the 0.7 MB download takes ~9 s.
    seeders = [processes.seeder(name, tiny_model, extra=["--upload-limit", "40"])[1] for name in ("s1", "s2")]
    boot = seeders[0]["addrs"][0]
    model_id = ModelStore(processes.root / "s1").get("tiny").model_id
    data_dir = tmp_path / "downloader"
    proc = subprocess.Popen(_fetch_cmd(data_dir, model_id, boot), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_held_pieces(data_dir, model_id)) < 12 and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    # Nothing corrupt: every model file under its own name is complete and verified;
    # the rest is in part files, whose pieces count only if they match their hashes.
    model = ModelStore(data_dir).get(model_id)
    assert_verified(model)
    manifest = model.manifest
    held = _held_pieces(data_dir, model_id)
    assert any(part_path(model, f.name).exists() for f in manifest.files)
    assert 12 <= len(held) < len(manifest.pieces)

    done = subprocess.run(_fetch_cmd(data_dir, model_id, boot), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    missing = set(range(len(manifest.pieces))) - held
    assert result["already_held"] == len(held)
    assert result["pieces"] == len(missing)
    assert result["bytes"] == sum(manifest.pieces[i].length for i in missing)
    model = ModelStore(data_dir).get(model_id)
    assert model.holds(blocks=(0, model.num_blocks), head=True)
    assert_verified(model)
    assert not list(model.path.glob(".*.part"))  # every part file became its file
