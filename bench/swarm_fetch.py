"""Swarm fetch: all of SmolLM2's stored weights from 1 and from 3 seeders.

    .venv/bin/python bench/swarm_fetch.py [--wan] [--raw-mib 256]

loopback  seeders are `compushare models seed` processes on 127.0.0.1, each holding
          the whole model; the downloader is `compushare models fetch ID --json` in a
          fresh data dir, bootstrapped to the first seeder only (it finds the others
          through the DHT). MB/s = bytes / download time, from the first request to
          the last piece verified, written and assembled into its file (process
          start-up and the manifest excluded).
raw       one libp2p stream between two processes (a source process writing 1 MiB
          chunks, this process reading): the ceiling for a single seeder here.
          The 3-seeder fetch runs --trials times, each right after a raw measurement
          of as many bytes; loopback_3_vs_raw is the median of the pairs' ratios
          (this machine's speed drifts by 2x within minutes), the MB/s figures are
          medians.
raw_3_verified  three raw sources (a third of the bytes each) into one reader that,
          like a fetch, hashes each MiB and writes it to a file in a worker thread,
          and fsyncs the file at the end: a 3-seeder fetch's processes and its
          mandatory work (verify, persist) without its protocol. Measured in each
          pair too, so loopback_3 / raw_3_verified says what the protocol costs and
          raw_3_verified / raw what the topology and the work cost on this machine.
wan       with --wan (root only): four hosts of the project's namespace harness
          (tools/netlab), seeders on hosts 1-3 with 20mbit links (tbf, upload and
          download), the downloader on host 4 unshaped, no added delay. The
          namespaces are removed on every exit path.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO  # noqa: E402  (this checkout's src/)

sys.path.insert(0, str(REPO / "tools"))
import netlab  # noqa: E402  (tools/netlab, the project's namespace harness)
import trio  # noqa: E402

from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.app.swarm import wait_ready  # noqa: E402

MODEL = "smollm2-135m"
NETLAB_PREFIX = "csf"  # our own namespace names: nothing else's lab is touched
WAN_RATES = ("20mbit", "20mbit", "20mbit", None)  # seeders shaped, the downloader not
RAW_PROTOCOL = "/compushare-bench/raw/1.0.0"
CHUNK = 1 << 20
FETCH_TIMEOUT_S = 900
TARGETS = {"wan_ratio_3v1": 2.7, "loopback_vs_raw": 0.6, "min_seeder_share": 0.2}


class Lab:
    """Processes and namespaces this run started; `close` ends them all (by pid)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.net: netlab.Lab | None = None  # the namespaces, with --wan

    def start(self, cmd: list[str], log: Path) -> subprocess.Popen:
        handle = open(log, "ab")
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self.procs.clear()

    def wan_up(self) -> None:
        self.net = netlab.Lab(netlab.Topology(NETLAB_PREFIX, hosts=4, rates=WAN_RATES))
        self.net.__enter__()  # removes a lab left by a killed earlier run first

    def in_ns(self, host: int | None, cmd: list[str]) -> list[str]:
        """`cmd` on namespace host `host` (None: here, on loopback)."""
        return cmd if host is None else self.net.wrap(host, cmd)

    def close(self) -> None:
        self.stop_all()
        if self.net is not None:
            self.net.close()
            self.net = None


def start_seeders(lab: Lab, root: Path, count: int, ips: list[str], hosts: list[int | None]) -> list[dict]:
    states, boot = [], []
    for i in range(count):
        data_dir = root / f"seeder{i}"
        resolve_model(MODEL, data_dir)  # hard-links the converted weights from the shared cache
        (data_dir / "node.json").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "compushare", "models", "seed", "--data-dir", str(data_dir),
               "--listen", f"/ip4/{ips[i]}/tcp/0", "--log-level", "warning"]
        for addr in boot:
            cmd += ["--bootstrap", addr]
        proc = lab.start(lab.in_ns(hosts[i], cmd), data_dir / "seed.log")
        states.append(wait_ready(proc, data_dir, timeout=120))
        if not boot:
            boot = states[0]["addrs"][:1]
    return states


def fetch_once(lab: Lab, root: Path, model_id: str, seeders: list[dict], host: int | None) -> dict:
    data_dir = root / f"downloader-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "compushare", "models", "fetch", model_id, "--data-dir", str(data_dir),
           "--bootstrap", seeders[0]["addrs"][0], "--json"]
    done = subprocess.run(lab.in_ns(host, cmd), capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"fetch failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(data_dir, ignore_errors=True)
    result["MBps"] = result["bytes"] / 1e6 / result["seconds"]
    total = sum(result["bytes_from"].values())
    by_peer = {s["peer_id"]: result["bytes_from"].get(s["peer_id"], 0) for s in seeders}
    result["shares"] = [count / total for count in by_peer.values()]
    print(f"  {len(seeders)} seeder(s): {result['bytes'] / 1e6:.1f} MB in {result['seconds']:.1f}s = "
          f"{result['MBps']:.2f} MB/s; bytes per seeder: {list(by_peer.values())}", flush=True)
    return result


# ---------------------------------------------------------------- one raw libp2p stream


async def _raw_source(mib: int, addr_file: Path) -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair

    from compushare.net.host import full_addrs, open_host

    chunk = os.urandom(CHUNK)

    async def handler(stream) -> None:
        for _ in range(mib):
            await stream.write(memoryview(chunk))  # as seeders write: yamux slices it without copies
        await stream.close()

    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as host:
        host.set_stream_handler(RAW_PROTOCOL, handler)
        addr_file.write_text(full_addrs(host)[0])
        await trio.sleep_forever()


async def _arriving(stream):
    """A stream's data as it arrives, until its end."""
    from libp2p.network.stream.exceptions import StreamEOF

    while True:
        try:
            data = await stream.read(CHUNK)
        except StreamEOF:
            return
        if not data:
            return
        yield data


async def _raw_sink(addr: str, mib: int) -> float:
    from libp2p.crypto.ed25519 import create_new_key_pair

    from compushare.net.host import open_host, parse_peer_addr

    info = parse_peer_addr(addr)
    async with open_host(create_new_key_pair(), []) as host:
        await host.connect(info)
        stream = await host.new_stream(info.peer_id, [RAW_PROTOCOL])
        received, began = 0, time.perf_counter()
        async for data in _arriving(stream):
            received += len(data)
        elapsed = time.perf_counter() - began
    if received != mib * CHUNK:
        raise RuntimeError(f"raw stream delivered {received} of {mib * CHUNK} bytes")
    return received / 1e6 / elapsed


async def _raw_sink_verified(addrs: list[str], mib_each: int, out_dir: Path) -> float:
    """One stream from each raw source at once into one file: every MiB hashed and
    written in a worker thread (one trip per MiB, as a fetch makes per piece), the
    file fsynced at the end."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from compushare.net.host import open_host, parse_peer_addr, widen_receive_window
    from compushare.torrent.fetch import PIPELINE_BYTES

    path = out_dir / f"verified-{time.monotonic_ns()}.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    kept = [0]

    def keep(chunk: bytes, offset: int) -> None:
        hashlib.sha256(chunk).digest()
        os.pwrite(fd, chunk, offset)

    async def drain(stream) -> None:
        pending: list[bytes] = []
        size = 0
        async for data in _arriving(stream):
            pending.append(data)
            size += len(data)
            while size >= CHUNK:
                joined = b"".join(pending)
                chunk, rest = joined[:CHUNK], joined[CHUNK:]
                pending, size = ([rest] if rest else []), len(rest)
                offset = kept[0]
                kept[0] += CHUNK
                await trio.to_thread.run_sync(keep, chunk, offset)

    try:
        async with open_host(create_new_key_pair(), []) as host:
            streams = []
            for addr in addrs:
                info = parse_peer_addr(addr)
                await host.connect(info)
                stream = await host.new_stream(info.peer_id, [RAW_PROTOCOL])
                await widen_receive_window(stream, PIPELINE_BYTES)  # the credit a fetch grants a seeder
                streams.append(stream)
            began = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for stream in streams:
                    nursery.start_soon(drain, stream)
            await trio.to_thread.run_sync(os.fsync, fd)
            elapsed = time.perf_counter() - began
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    if kept[0] != len(addrs) * mib_each * CHUNK:
        raise RuntimeError(f"raw sources delivered {kept[0]} of {len(addrs) * mib_each * CHUNK} bytes")
    return kept[0] / 1e6 / elapsed


def raw_3_verified_mbps(addrs: list[str], mib_each: int, out_dir: Path) -> float:
    rate = trio.run(_raw_sink_verified, addrs, mib_each, out_dir)
    print(f"  {len(addrs)} raw streams, hashed and written: {len(addrs) * mib_each} MiB at {rate:.2f} MB/s",
          flush=True)
    return rate


def start_raw_source(lab: Lab, root: Path, mib: int, name: str = "raw") -> str:
    addr_file = root / f"{name}.addr"
    lab.start([sys.executable, __file__, "--raw-source", str(addr_file), "--raw-mib", str(mib)], root / f"{name}.log")
    deadline = time.monotonic() + 60
    while not addr_file.exists() or not addr_file.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError("the raw stream source did not start")
        time.sleep(0.1)
    return addr_file.read_text()


def raw_stream_mbps(addr: str, mib: int) -> float:
    rate = trio.run(_raw_sink, addr, mib)
    print(f"  one libp2p stream: {mib} MiB at {rate:.2f} MB/s", flush=True)
    return rate


# ---------------------------------------------------------------- the runs


def run_scenario(lab: Lab, root: Path, model_id: str, *, wan: bool, trials: int = 1,
                 raw_mib: int = 0) -> tuple[dict, dict, list[float], list[float]]:
    """1 seeder once, then `trials` fetches from 3 seeders; on loopback each of those
    follows a raw-stream and a raw_3_verified measurement (side by side: this
    machine's speed drifts). Returns the 1-seeder result, the median 3-seeder result
    and the two references' rates."""
    ips = [lab.net.addr(i) for i in (1, 2, 3)] if wan else ["127.0.0.1"] * 3
    hosts: list[int | None] = [1, 2, 3] if wan else [None] * 3
    downloader = 4 if wan else None
    print(f"{'wan (20mbit seeders)' if wan else 'loopback'}:", flush=True)
    one = fetch_once(lab, root, model_id, start_seeders(lab, root, 1, ips, hosts), downloader)
    lab.stop_all()
    raw_addr = start_raw_source(lab, root, raw_mib) if raw_mib else None
    verified_addrs = [start_raw_source(lab, root, raw_mib // 3, f"raw3v-{i}") for i in range(3)] if raw_mib else []
    seeders = start_seeders(lab, root, 3, ips, hosts)
    threes, raws, verifieds = [], [], []
    for _ in range(trials):
        if raw_addr:
            raws.append(raw_stream_mbps(raw_addr, raw_mib))
            verifieds.append(raw_3_verified_mbps(verified_addrs, raw_mib // 3, root))
        threes.append(fetch_once(lab, root, model_id, seeders, downloader))
        if raws:
            threes[-1]["vs_raw"] = threes[-1]["MBps"] / raws[-1]
            threes[-1]["vs_raw_3_verified"] = threes[-1]["MBps"] / verifieds[-1]
    lab.stop_all()
    three = sorted(threes, key=lambda r: r["MBps"])[len(threes) // 2]
    if raws:  # the ratio of each side-by-side pair, then their median
        three["vs_raw"] = statistics.median(r["vs_raw"] for r in threes)
        three["vs_raw_3_verified"] = statistics.median(r["vs_raw_3_verified"] for r in threes)
        three["raw_3_verified_vs_raw"] = statistics.median(v / r for v, r in zip(verifieds, raws))
    return one, three, raws, verifieds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wan", action="store_true", help="also run in tools/netlab namespaces (root)")
    parser.add_argument("--raw-mib", type=int, default=512, help="as much as a fetch moves: both take as long")
    parser.add_argument("--trials", type=int, default=3, help="loopback 3-seeder fetches (median), each "
                                                                 "after a raw-stream measurement")
    parser.add_argument("--raw-source", type=Path, help=argparse.SUPPRESS)  # internal: the raw stream's sender
    args = parser.parse_args()
    if args.raw_source:
        trio.run(_raw_source, args.raw_mib, args.raw_source)
        return
    if args.wan and os.geteuid() != 0:
        parser.error("--wan needs root (network namespaces)")

    lab = Lab()
    root = Path(tempfile.mkdtemp(prefix="compushare-swarm-fetch-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    try:
        model = resolve_model(MODEL, root / "reference")
        size = model.manifest.total_bytes
        print(f"{MODEL} ({model.model_id[:12]}): {size / 1e6:.1f} MB stored in {len(model.manifest.pieces)} "
              f"pieces of {model.manifest.piece_size // 1024} KiB", flush=True)
        lo1, lo3, raws, verifieds = run_scenario(lab, root, model.model_id, wan=False, trials=args.trials,
                                                 raw_mib=args.raw_mib)
        raw = statistics.median(raws)
        wan1 = wan3 = None
        if args.wan:
            lab.wan_up()
            wan1, wan3, _, _ = run_scenario(lab, root, model.model_id, wan=True)
    finally:
        lab.close()
        shutil.rmtree(root, ignore_errors=True)

    result = {
        "bytes": size,
        "loopback_1_MBps": round(lo1["MBps"], 2),
        "loopback_3_MBps": round(lo3["MBps"], 2),
        "raw_stream_MBps": round(raw, 2),
        "loopback_3_vs_raw": round(lo3["vs_raw"], 3),
        "raw_stream_trials_MBps": [round(r, 2) for r in raws],
        "raw_3_verified_MBps": round(statistics.median(verifieds), 2),
        "raw_3_verified_trials_MBps": [round(v, 2) for v in verifieds],
        "raw_3_verified_vs_raw": round(lo3["raw_3_verified_vs_raw"], 3),
        "loopback_3_vs_raw_3_verified": round(lo3["vs_raw_3_verified"], 3),
        "wan_1_MBps": round(wan1["MBps"], 2) if wan1 else None,
        "wan_3_MBps": round(wan3["MBps"], 2) if wan3 else None,
        "wan_ratio_3v1": round(wan3["MBps"] / wan1["MBps"], 3) if wan1 else None,
        "min_seeder_share": round(min((wan3 or lo3)["shares"]), 3),
        "loopback_3_shares": [round(s, 3) for s in lo3["shares"]],
        "wan_3_shares": [round(s, 3) for s in wan3["shares"]] if wan3 else None,
        "piece_size": model.manifest.piece_size,
    }
    result["targets_met"] = {
        "wan_ratio_3v1": None if wan1 is None else result["wan_ratio_3v1"] >= TARGETS["wan_ratio_3v1"],
        "loopback_3_vs_raw": result["loopback_3_vs_raw"] >= TARGETS["loopback_vs_raw"],
        "min_seeder_share": result["min_seeder_share"] >= TARGETS["min_seeder_share"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
