"""Gossip delivery: how fast a capability ad reaches every other node of a 30-node swarm.

    .venv/bin/python bench/gossip.py [--nodes 30] [--period 5] [--window-periods 4] [--keep]

Every node is a separate OS process: its own temp data dir and Ed25519 identity, its
own trio loop, one libp2p host on 127.0.0.1:0 built by net/host.open_host, and the
project's real gossip code, net/gossip.open_gossip (GossipSub v1.1, the ad topic
validator, the view's rate/replay rules, the dial-from-ads mesh keeper), publishing
a realistic signed ad (net/ads.make_ad: this machine's hardware, detected once, and
one Serving entry for a fake model span, so all on that model's topic) every
`--period` seconds, the production AD_PERIOD_S by default. Its ads live three
`--period`s, which holds the period there: the stretch of a crowded topic
(net/ad_intake.ad_period, never past a third of an ad's lifetime) stays off. The bench process runs no libp2p host: it imports the
libp2p stack once and forks the members from itself (no trio loop, socket or thread
exists in it before the fork), so 30 interpreters do not each burn seconds of CPU on
imports while the others already gossip; `--launch exec` starts a fresh interpreter
per member instead (this file run with --member).

Start-up: the first `--bootstraps` members start one after another (each dials the
ones before it); every later member, launched one per `--join-interval` seconds,
dials `--joins` of them (rotating pairs) once its gossip is running and finds the
rest of the swarm through ads, like a real node. Each member writes a ready file,
then a status line every second.

Measurement: every member appends, flushed line by line, one JSON record per ad it
signs ("pub": seq, sent) and per ad accepted into its view ("recv": publisher,
seq, sent, arrival = time.time() inside the on_ad callback, i.e. after signature
and view checks). All processes share one machine clock. After the last member is
ready the swarm gets `--warmup` seconds to form its mesh; then a window of
`--window-periods` publish periods opens. Every ad whose `sent` lies in the window
is expected at each of the other N-1 members:
    latency = arrival - sent, over the (ad, receiver) pairs that arrived;
    delivered_fraction = arrived pairs / (ads in window x (N-1)).
Arrivals are collected until `--drain` seconds after the window closes: a later one
counts as lost (so does every expected arrival at a member that crashed). p50/p95
are nearest-rank percentiles of the latencies. Ads a receiver never logged but for
which it did log a newer ad of the same publisher are reported separately
("superseded"); they still count as lost. The same figures are also given for the
receivers other than the bootstrap members, and per receiver for the slowest five.

This machine may be shared: the bench waits (up to `--wait-quiet` s) for it to be
under 25% busy before starting, and accounts the CPU of every window from
/proc/stat: members, other jobs, softirq, steal. Should other jobs take more than
10% of the CPU in a window, another window follows (up to `--max-windows`) and the
least disturbed one is reported; every window's numbers are in the JSON too. All
30 members share the machine's cores: when they need more CPU than it has, the
latencies measure CPU queueing as much as gossip, and the bench says so.

Also reported: the GossipSub mesh size, the number of subscribed peers
(Gossip.subscribed_peers) and connections per member, the members' GossipSub
heartbeat interval and network-health score (py-libp2p adapts the former to the
latter), why the validators rejected ads, each member's CPU in the window and the
worst wake-up lag of its trio loop.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO  # noqa: E402  (this checkout's src/)

TARGET_DELIVERED = 0.95
TARGET_P95_S = 2.0
FAKE_MODEL_ID = "5e" * 32  # 64 hex digits; what is served does not matter for delivery
READY_FILE = "ready.json"
STATUS_FILE = "status.json"
EVENTS_FILE = "events.jsonl"
STOP_TIMEOUT_S = 8.0
OTHERS_LIMIT = 0.10  # share of the machine's CPU other jobs may take in a reported window


def log(text: str = "") -> None:
    print(text, flush=True)


# =========================================================================== member


def _die_with_parent() -> None:
    """Linux: have the kernel SIGTERM this member when the bench process dies, even
    by SIGKILL (the member also polls its parent pid, for other systems)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def member_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gossip.py --member")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--period", type=float, required=True)
    parser.add_argument("--hardware", required=True, help="Hardware.to_wire() as JSON")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--max-lifetime", type=float, default=1200.0)
    args = parser.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.parent_pid:
        return 1  # the bench died while we were starting

    import trio

    data_dir = Path(args.dir)
    # Line-buffered: every record is one write(2), readable by the parent at once.
    with open(data_dir / EVENTS_FILE, "w", buffering=1) as events, \
            open(data_dir / "statuses.jsonl", "w", buffering=1) as statuses:
        try:
            trio.run(_member, args, events, statuses)
        except KeyboardInterrupt:
            pass
    return 0


async def _member(args, events, statuses) -> None:
    import trio

    from compushare import __version__
    from compushare.hardware import Hardware
    from compushare.net.ad_intake import ad_topic
    from compushare.net.ads import Serving, ad_ttl, make_ad
    from compushare.net.gossip import open_gossip
    from compushare.net.host import full_addrs, open_host, parse_peer_addr
    from compushare.net.identity import load_or_create_identity
    from compushare.net.view import SwarmView

    data_dir = Path(args.dir)
    hardware = Hardware.from_wire(json.loads(args.hardware))
    key_pair = load_or_create_identity(data_dir)
    serving = [Serving(FAKE_MODEL_ID, 0, 10, "float32", free_tokens=4096, load=0.1, block_rate=40.0)]

    def record(obj: dict) -> None:
        events.write(json.dumps(obj, separators=(",", ":")) + "\n")

    async with open_host(key_pair, ["/ip4/127.0.0.1/tcp/0"]) as host:
        me = host.get_id().to_string()
        addrs = full_addrs(host)

        last_seq = 0

        def new_ad():  # as node.py's make_our_ad: growing seq, TTL from the period
            nonlocal last_seq
            last_seq = max(last_seq + 1, time.time_ns())
            ad = make_ad(key_pair, me, addrs, hardware, serving, __version__,
                         ttl_s=ad_ttl(args.period), seq=last_seq)
            record({"e": "pub", "q": ad.seq, "s": ad.sent})
            return ad

        def on_ad(ad) -> None:
            arrival = time.time()
            if ad.peer_id != me:  # our own publication passes our validator too
                record({"e": "recv", "p": ad.peer_id, "q": ad.seq, "s": ad.sent, "a": arrival})

        class CountingView(SwarmView):
            """The project's view, unchanged, counting why it turns ads away (for the report)."""

            def __init__(self) -> None:
                super().__init__()
                self.reasons: collections.Counter = collections.Counter()

            def offer(self, ad, now):
                offer = super().offer(ad, now)
                if not offer.accepted:
                    self.reasons[" ".join(offer.reason.split()[:2])] += 1
                return offer

        view = CountingView()
        async with open_gossip(host, view, new_ad, period_s=args.period, on_ad=on_ad) as gossip, \
                trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

            async def watchdog() -> None:
                deadline = trio.current_time() + args.max_lifetime
                while os.getppid() == args.parent_pid and trio.current_time() < deadline:
                    await trio.sleep(1.0)
                nursery.cancel_scope.cancel()

            lag = {"max": 0.0}

            async def lag_probe() -> None:
                """How late this process's trio loop wakes up: a sign of CPU starvation."""
                while True:
                    began = trio.current_time()
                    await trio.sleep(0.25)
                    lag["max"] = max(lag["max"], trio.current_time() - began - 0.25)

            nursery.start_soon(stop_on_signal)
            nursery.start_soon(watchdog)
            nursery.start_soon(lag_probe)

            # Bootstrap after gossip has started: pubsub learns peers from connection events.
            connected = []
            for text in args.bootstrap:
                info = parse_peer_addr(text)
                for attempt in range(5):
                    try:
                        with trio.fail_after(10):
                            await host.connect(info)
                        connected.append(info.peer_id.to_string())
                        break
                    except Exception as exc:  # noqa: BLE001  (retried, then reported in the ready file)
                        record({"e": "dial_error", "to": text, "error": repr(exc)[:200]})
                        await trio.sleep(0.5 * (attempt + 1))
            _write_json_atomic(data_dir / READY_FILE, {"peer": me, "addrs": addrs, "pid": os.getpid(),
                                                       "bootstrapped": connected, "t": time.time()})

            router = gossip.pubsub.router
            while True:
                status = {
                    "t": time.time(),
                    "view_live": len(view.live(time.time())),
                    "subscribed": len(gossip.subscribed_peers()),
                    "mesh": len(getattr(router, "mesh", {}).get(ad_topic(FAKE_MODEL_ID), ())),
                    "connections": len(host.get_network().connections),
                    "heartbeat_s": getattr(router, "heartbeat_interval", None),
                    "health": getattr(router, "network_health_score", None),
                    "published": gossip.published,
                    "rejected": view.rejected,
                    "reject_reasons": dict(view.reasons),
                    "cpu_s": time.process_time(),
                    "loop_lag_max_s": lag["max"],
                }
                lag["max"] = 0.0
                _write_json_atomic(data_dir / STATUS_FILE, status)
                statuses.write(json.dumps(status) + "\n")
                await trio.sleep(1.0)


# =========================================================================== bench


class Cleanup:
    """Stops every member process we started (SIGTERM, then SIGKILL, by pid) and
    removes the temp dir. Runs from `finally`, atexit and on SIGTERM/SIGHUP; idempotent."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="compushare-gossip-bench-"))
        self._done = False
        self.keep = False
        atexit.register(self.run)

    def stop_members(self, timeout: float = STOP_TIMEOUT_S) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    proc.wait(timeout=5)

    def run(self) -> None:
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):
            self.stop_members()
        if not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


class Member:
    def __init__(self, index: int, data_dir: Path, proc: subprocess.Popen, launched: float) -> None:
        self.index, self.dir, self.proc, self.launched = index, data_dir, proc, launched
        self.ready: dict | None = None

    def poll_ready(self) -> bool:
        if self.ready is None and (self.dir / READY_FILE).exists():
            self.ready = json.loads((self.dir / READY_FILE).read_text())
        if self.ready is None and self.proc.poll() is not None:
            err = (self.dir / "stderr.txt").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"member {self.index} exited with {self.proc.returncode} before ready:\n{err}")
        return self.ready is not None

    def status(self) -> dict | None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.dir / STATUS_FILE).read_text())
        return None

    def window_status(self, w0: float, w1: float) -> dict:
        """From the member's once-a-second status log over the window: the worst trio
        loop wake-up lag and the median GossipSub mesh size."""
        rows = []
        with contextlib.suppress(OSError):
            for line in (self.dir / "statuses.jsonl").read_text().splitlines():
                with contextlib.suppress(ValueError):
                    row = json.loads(line)
                    if w0 <= row["t"] <= w1 + 1.0:
                        rows.append(row)
        if not rows:
            return {}
        return {"lag": max(r["loop_lag_max_s"] for r in rows), "mesh": statistics.median(r["mesh"] for r in rows)}

    def cpu_s(self) -> float | None:
        """utime + stime of the member, from /proc (Linux)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None


PROC_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu_s() -> dict[str, float] | None:
    """The machine's CPU seconds so far by kind (user, system, softirq, steal, ...), from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return {name: value / tick for name, value in zip(PROC_STAT_FIELDS, fields)}


def cpu_breakdown(before: dict | None, after: dict | None, member_cpu: float) -> dict | None:
    """Shares of the machine's CPU time between two /proc/stat readings. `others` is
    user+nice+system time not spent by the members (other jobs, this process); softirq
    (loopback TCP is mostly processed there) and steal (taken by the hypervisor) are
    reported apart."""
    if not before or not after:
        return None
    delta = {k: after[k] - before[k] for k in PROC_STAT_FIELDS}
    total = sum(delta.values()) or 1.0
    task = delta["user"] + delta["nice"] + delta["system"]
    return {
        "busy": round(1 - (delta["idle"] + delta["iowait"]) / total, 3),
        "members": round(member_cpu / total, 3),
        "others": round(max(0.0, task - member_cpu) / total, 3),
        "irq_softirq": round((delta["irq"] + delta["softirq"]) / total, 3),
        "steal": round(delta["steal"] / total, 3),
    }


def machine_busy(sample_s: float = 3.0) -> float | None:
    before = machine_cpu_s()
    time.sleep(sample_s)
    after = machine_cpu_s()
    shares = cpu_breakdown(before, after, 0.0)
    return shares and shares["busy"]


def wait_quiet(limit_s: float, threshold: float = 0.25) -> float | None:
    """Wait up to `limit_s` for the machine to be less than `threshold` busy (other
    jobs sharing it would be measured as gossip latency); return the last reading."""
    deadline = time.monotonic() + limit_s
    busy = machine_busy()
    while busy is not None and busy >= threshold and time.monotonic() < deadline:
        log(f"  machine {100 * busy:.0f}% busy before start: waiting for it to calm down")
        busy = machine_busy(5.0)
    return busy


class ForkedChild:
    """The part of subprocess.Popen's interface the bench uses, for a forked member."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
            else:
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"member pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


def preload_member_modules() -> None:
    """Import the libp2p stack once, in this process, before forking the members
    (the parent never starts trio, opens no socket and runs no thread)."""
    import trio  # noqa: F401

    import compushare.net.ads
    import compushare.net.gossip
    import compushare.net.host
    import compushare.net.identity
    import compushare.net.view  # noqa: F401


def fork_member(argv: list[str], stderr_path: Path) -> ForkedChild:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedChild(pid)
    code = 1  # the child: never return into the bench (nor run its atexit handlers)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        code = member_main(argv)
    except BaseException:  # noqa: BLE001  (reported on the member's stderr)
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def launch(cleanup: Cleanup, index: int, bootstrap: list[str], args, hardware_json: str) -> Member:
    data_dir = cleanup.tmp / f"member-{index:02d}"
    data_dir.mkdir()
    argv = ["--dir", str(data_dir), "--index", str(index), "--period", str(args.period),
            "--hardware", hardware_json, "--parent-pid", str(os.getpid()),
            "--max-lifetime", str(args.max_wall + 60)]
    for addr in bootstrap:
        argv += ["--bootstrap", addr]
    if args.launch == "fork":
        proc = fork_member(argv, data_dir / "stderr.txt")
    else:
        with open(data_dir / "stderr.txt", "wb") as err:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--member", *argv],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    cwd=str(REPO))
    cleanup.procs.append(proc)
    return Member(index, data_dir, proc, time.time())


def detect_hardware_wire() -> str:
    """detect_hardware() in a short-lived interpreter: it imports torch, which must not
    be in the process the members are forked from."""
    code = ("import json; from compushare.hardware import detect_hardware; "
            "print(json.dumps(detect_hardware().to_wire()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


def wait_ready(members: list[Member], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(m.poll_ready() for m in members):
        if time.monotonic() > deadline:
            late = [m.index for m in members if m.ready is None]
            raise RuntimeError(f"members {late} not ready after {timeout:.0f}s")
        time.sleep(0.1)


def start_swarm(cleanup: Cleanup, args, hardware_json: str) -> list[Member]:
    members: list[Member] = []
    boot_addrs: list[str] = []
    for index in range(min(args.bootstraps, args.nodes)):  # one after another, each dials the earlier ones
        member = launch(cleanup, index, boot_addrs[:], args, hardware_json)
        wait_ready([member], args.start_timeout)
        members.append(member)
        boot_addrs.append(member.ready["addrs"][0])
        log(f"  bootstrap member {index} ready after {member.ready['t'] - member.launched:.1f}s "
            f"({member.ready['peer'][-8:]}, pid {member.proc.pid})")
    starting: list[Member] = []
    next_launch = time.monotonic()
    for index in range(len(members), args.nodes):
        # A steady join rate, and never more than --concurrency members starting at once.
        while len(starting) >= args.concurrency or time.monotonic() < next_launch:
            starting = [m for m in starting if not m.poll_ready()]
            time.sleep(0.05)
        next_launch = time.monotonic() + args.join_interval
        joins = [boot_addrs[(index + k) % len(boot_addrs)] for k in range(min(args.joins, len(boot_addrs)))]
        member = launch(cleanup, index, joins, args, hardware_json)
        members.append(member)
        starting.append(member)
    wait_ready(members, args.start_timeout)
    return members


# --------------------------------------------------------------------------- analysis


def last_error(member: Member) -> str:
    """The last exception line in a member's stderr (tracebacks there are ExceptionGroups)."""
    found = ""
    with contextlib.suppress(OSError):
        for line in (member.dir / "stderr.txt").read_text(errors="replace").splitlines():
            text = line.strip(" |+-")
            if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b.*", text) and "Group" not in text:
                found = text
    return found[:300]


_REPORTED_DEATHS: set[int] = set()


def report_deaths(members: list[Member]) -> list[dict]:
    """Members that exited on their own. They stay in the count: a crashed node's
    missing arrivals are losses, as in a real swarm."""
    died = []
    for m in members:
        if m.proc.poll() is not None:
            died.append({"member": m.index, "exit": m.proc.returncode, "error": last_error(m)})
            if m.index not in _REPORTED_DEATHS:
                _REPORTED_DEATHS.add(m.index)
                log(f"  WARNING: member {m.index} (pid {m.proc.pid}) exited with {m.proc.returncode}: "
                    f"{died[-1]['error'] or 'no error on stderr'}")
    return died


def read_events(member: Member) -> tuple[list[dict], list[dict], list[dict]]:
    pubs, recvs, errors = [], [], []
    with open(member.dir / EVENTS_FILE) as handle:
        for line in handle:
            if not line.endswith("\n"):
                break  # a record cut short by the stop
            event = json.loads(line)
            {"pub": pubs, "recv": recvs}.get(event["e"], errors).append(event)
    return pubs, recvs, errors


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of an ascending list."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarise(latencies: list[float], expected: int) -> dict:
    latencies = sorted(latencies)
    return {
        "expected_pairs": expected,
        "delivered_pairs": len(latencies),
        "delivered_fraction": len(latencies) / expected if expected else 0.0,
        "p50_s": percentile(latencies, 50),
        "p90_s": percentile(latencies, 90),
        "p95_s": percentile(latencies, 95),
        "p99_s": percentile(latencies, 99),
        "max_s": latencies[-1] if latencies else None,
        "mean_s": statistics.fmean(latencies) if latencies else None,
    }


def analyse(members: list[Member], window: tuple[float, float], bootstraps: int) -> dict:
    w0, w1 = window
    index_of = {m.ready["peer"]: m.index for m in members}
    arrivals: dict[str, dict[tuple[str, int], float]] = {}  # receiver -> (publisher, seq) -> arrival
    newest_seq: dict[str, dict[str, int]] = {}  # receiver -> publisher -> newest seq received
    published: list[tuple[str, int, float]] = []
    dial_errors = 0
    for m in members:
        pubs, recvs, errors = read_events(m)
        dial_errors += sum(1 for e in errors if e.get("e") == "dial_error")
        me = m.ready["peer"]
        published += [(me, p["q"], p["s"]) for p in pubs]
        arrivals[me] = {(r["p"], r["q"]): r["a"] for r in recvs}
        newest: dict[str, int] = {}
        for r in recvs:
            newest[r["p"]] = max(newest.get(r["p"], 0), r["q"])
        newest_seq[me] = newest
    in_window = [(peer, seq, sent) for peer, seq, sent in published if w0 <= sent < w1]
    receivers = list(arrivals)
    per_receiver: dict[str, list[float]] = {r: [] for r in receivers}
    lost = collections.Counter()
    superseded = 0
    per_ad_reach: list[int] = []
    for peer, seq, sent in in_window:
        reached = 0
        for receiver in receivers:
            if receiver == peer:
                continue
            arrival = arrivals[receiver].get((peer, seq))
            if arrival is None:
                lost[receiver] += 1
                superseded += newest_seq[receiver].get(peer, 0) > seq
            else:
                reached += 1
                per_receiver[receiver].append(arrival - sent)
        per_ad_reach.append(reached)
    expected = {r: sum(1 for peer, _, _ in in_window if peer != r) for r in receivers}
    result = summarise([x for r in receivers for x in per_receiver[r]], sum(expected.values()))
    others = [r for r in receivers if index_of[r] >= bootstraps]
    result.update({
        "ads_in_window": len(in_window),
        "lost_pairs": sum(lost.values()),
        "superseded_pairs": superseded,
        "ads_reaching_all": sum(1 for r in per_ad_reach if r == len(receivers) - 1),
        "min_reach": min(per_ad_reach) if per_ad_reach else None,
        "per_receiver": {index_of[r]: summarise(per_receiver[r], expected[r]) for r in receivers},
        "non_bootstrap_receivers": summarise([x for r in others for x in per_receiver[r]],
                                             sum(expected[r] for r in others)),
        "dial_errors": dial_errors,
        "published_total": len(published),
    })
    return result


def spread(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def machine_info() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    from importlib.metadata import version

    return {"cpu": cpu, "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "libp2p": version("libp2p"), "trio": version("trio"),
            "platform": platform.platform()}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=30)
    parser.add_argument("--period", type=float, default=None, help="ad period in seconds (default: AD_PERIOD_S)")
    parser.add_argument("--window-periods", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds after the last member is ready")
    parser.add_argument("--drain", type=float, default=10.0, help="seconds arrivals may take after the window")
    parser.add_argument("--bootstraps", type=int, default=3)
    parser.add_argument("--joins", type=int, default=2, help="bootstrap members each later member dials")
    parser.add_argument("--concurrency", type=int, default=3, help="members starting at once")
    parser.add_argument("--join-interval", type=float, default=1.0,
                        help="seconds between the launches of the non-bootstrap members")
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--max-wall", type=float, default=900.0)
    parser.add_argument("--wait-quiet", type=float, default=60.0,
                        help="seconds to wait, at most, for the machine to be <25%% busy before starting")
    parser.add_argument("--max-windows", type=int, default=3,
                        help="measure another window while other jobs take more than 10%% of the CPU")
    parser.add_argument("--launch", choices=("fork", "exec"), default="fork",
                        help="fork members from this process after importing libp2p once (default), or exec a "
                             "fresh interpreter per member")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (member logs) for inspection")
    args = parser.parse_args()

    wall_began = time.time()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    cleanup = Cleanup()
    cleanup.keep = args.keep
    try:
        from compushare.net.ads import AD_PERIOD_S

        if args.period is None:
            args.period = AD_PERIOD_S
        hardware_json = detect_hardware_wire()
        if args.launch == "fork":
            preload_member_modules()
        cpus = os.cpu_count()
        log(f"gossip delivery bench: {args.nodes} nodes, one libp2p host per OS process "
            f"({args.nodes} member processes, {'forked from' if args.launch == 'fork' else 'exec-ed by'} this one, "
            "which only coordinates), 127.0.0.1 only")
        log(f"ad period {args.period:g}s (AD_PERIOD_S = {AD_PERIOD_S:g}), window {args.window_periods:g} periods, "
            f"warm-up {args.warmup:g}s, drain {args.drain:g}s; {args.bootstraps} bootstrap members, each later "
            f"member (one every {args.join_interval:g}s) dials {args.joins} of them; machine: {cpus} CPUs; "
            f"temp {cleanup.tmp}")

        busy_before = wait_quiet(args.wait_quiet)
        log(f"machine {_fmt(busy_before and 100 * busy_before, 0)}% busy just before start")
        began = time.time()
        members = start_swarm(cleanup, args, hardware_json)
        all_ready = max(m.ready["t"] for m in members)
        startup_s = all_ready - began
        launch_to_ready = statistics.median(m.ready["t"] - m.launched for m in members)
        log(f"all {len(members)} members ready after {startup_s:.1f}s "
            f"(per member, launch to ready: median {launch_to_ready:.1f}s)")

        # Warm-up: let the mesh form; report when every view holds every peer.
        converged_s = None
        warm_end = all_ready + args.warmup
        while time.time() < warm_end:
            if converged_s is None:
                statuses = [m.status() for m in members]
                if all(s and s["view_live"] == args.nodes for s in statuses):
                    converged_s = time.time() - all_ready
                    log(f"every view holds all {args.nodes} live ads {converged_s:.1f}s "
                        "after the last member was ready")
            time.sleep(0.25)
        if converged_s is None:
            views = [s["view_live"] if s else None for s in (m.status() for m in members)]
            log(f"after the warm-up not every view is complete: live ads per view {spread(views)}")

        report_deaths(members)
        # Measurement windows back to back. Other jobs on this machine (it may be
        # shared) would be measured as gossip latency: a window in which they took more
        # than OTHERS_LIMIT of the CPU is followed by another, up to --max-windows; the
        # least disturbed one is reported (chosen by that share alone, never by result).
        windows: list[dict] = []
        for _ in range(args.max_windows):
            window = measure_window(members, args.window_periods * args.period)
            windows.append(window)
            others = window["shares"]["others"] if window["shares"] else 0.0
            if others <= OTHERS_LIMIT:
                break
            log(f"  other jobs took {100 * others:.0f}% of the machine's CPU in this window")
        time.sleep(args.drain)
        statuses = [m.status() or {} for m in members]
        died = report_deaths(members)
        alive = len(members) - len(died)
        cleanup.stop_members()

        for window in windows:
            window["result"] = analyse(members, (window["w0"], window["w1"]), args.bootstraps)
        chosen = min(windows, key=lambda w: w["shares"]["others"] if w["shares"] else 0.0)
        w0, w1, shares = chosen["w0"], chosen["w1"], chosen["shares"]
        member_cpu, load1 = chosen["member_cpu"], chosen["load"]
        cpu_util = member_cpu / (w1 - w0) / (cpus or 1)
        per_member_cpu = chosen["per_member_cpu"]
        in_window = [m.window_status(w0, w1) for m in members]
        lag = spread([round(w["lag"], 3) for w in in_window if w])
        mesh_window = spread([w["mesh"] for w in in_window if w])
        busy = shares and shares["busy"]
        if len(windows) > 1:
            log(f"{len(windows)} windows measured; reporting window {windows.index(chosen) + 1}, the one least "
                "disturbed by other jobs. All windows: " + "; ".join(
                    f"others {100 * (w['shares'] or {}).get('others', 0):.0f}%: delivered "
                    f"{w['result']['delivered_fraction']:.3f}, p95 {_fmt(w['result']['p95_s'], 2)}s" for w in windows))

        result = chosen["result"]
        mesh = spread([s.get("mesh") for s in statuses])
        subscribed = spread([s.get("subscribed") for s in statuses])
        connections = spread([s.get("connections") for s in statuses])
        views = spread([s.get("view_live") for s in statuses])
        heartbeats = collections.Counter(s.get("heartbeat_s") for s in statuses)
        health = spread([round(s["health"], 3) for s in statuses if s.get("health") is not None])
        rejected = sum(s.get("rejected", 0) for s in statuses)
        reasons = collections.Counter()
        for s in statuses:
            reasons.update(s.get("reject_reasons", {}))
        reasons["failed parse_ad (bad or expired)"] = rejected - sum(reasons.values())

        log()
        log(f"ads signed in the window: {result['ads_in_window']} "
            f"(x {args.nodes - 1} receivers = {result['expected_pairs']} expected arrivals)")
        log(f"delivered {result['delivered_pairs']} / {result['expected_pairs']} = "
            f"{result['delivered_fraction']:.4f} (target >= {TARGET_DELIVERED}); lost {result['lost_pairs']}, "
            f"of which superseded by a newer ad of the same peer {result['superseded_pairs']}")
        log(f"latency publish->arrival: p50 {_fmt(result['p50_s'])}s  p90 {_fmt(result['p90_s'])}s  "
            f"p95 {_fmt(result['p95_s'])}s (target <= {TARGET_P95_S})  p99 {_fmt(result['p99_s'])}s  "
            f"max {_fmt(result['max_s'])}s")
        log(f"ads that reached all {args.nodes - 1} others: {result['ads_reaching_all']} / {result['ads_in_window']}; "
            f"fewest receivers of one ad: {result['min_reach']}")
        nb = result["non_bootstrap_receivers"]
        log(f"receivers other than the {args.bootstraps} bootstrap members: delivered {nb['delivered_fraction']:.4f}, "
            f"p50 {_fmt(nb['p50_s'])}s, p95 {_fmt(nb['p95_s'])}s")
        slowest = sorted(result["per_receiver"].items(), key=lambda kv: -(kv[1]["p95_s"] or math.inf))[:5]
        slowest_out = []
        for index, r in slowest:
            st = statuses[index]
            slowest_out.append({"member": index, "bootstrap": index < args.bootstraps,
                                "connections": st.get("connections"), "mesh": st.get("mesh"),
                                "cpu": _round(chosen["cpu_by_member"].get(index), 3),
                                "delivered_fraction": round(r["delivered_fraction"], 4),
                                "p50_s": _round(r["p50_s"]), "p95_s": _round(r["p95_s"])})
        log("slowest receivers: " + "; ".join(
            f"member {o['member']}{' (bootstrap)' if o['bootstrap'] else ''} {o['connections']} connections, "
            f"mesh {o['mesh']}, {_fmt(o['cpu'], 3)} CPUs: delivered {o['delivered_fraction']:.3f}, "
            f"p95 {_fmt(o['p95_s'], 2)}s" for o in slowest_out))
        log(f"GossipSub mesh size per member (median over the window): {mesh_window}")
        log(f"at the end: GossipSub mesh size {mesh}, subscribed peers {subscribed}, connections {connections}, "
            f"live ads per view {views}; {alive}/{len(members)} members alive")
        log(f"GossipSub heartbeat interval per member (s): {dict(heartbeats)}; network health {health}; "
            f"ads rejected by validators (whole run): {rejected} {dict(reasons)}; dial errors: {result['dial_errors']}")
        log(f"member CPU during the window: {member_cpu:.1f} CPU-s over {w1 - w0:.1f}s = "
            f"{100 * cpu_util:.0f}% of {cpus} CPUs (per member, CPUs: {per_member_cpu}); machine CPU shares "
            f"{shares}; load average {load1:.2f}; "
            f"worst trio loop wake-up lag per member in the window {lag}")
        log(f"the machine was {_fmt(busy and 100 * busy, 0)}% busy during the window"
            + (" (saturated: these latencies measure CPU queueing as much as gossip)" if busy and busy > 0.9 else ""))
        ok_delivered = result["delivered_fraction"] >= TARGET_DELIVERED
        ok_p95 = result["p95_s"] is not None and result["p95_s"] <= TARGET_P95_S
        log(f"targets: delivered_fraction {'OK' if ok_delivered else 'BELOW TARGET'}, "
            f"p95_s {'OK' if ok_p95 else 'ABOVE TARGET'}")
        wall_s = time.time() - wall_began
        log(f"wall time {wall_s:.1f}s")

        summary = {
            "nodes": args.nodes,
            "processes": len({m.proc.pid for m in members}),
            "hosts_per_process": 1,
            "launch": args.launch,
            "p50_s": _round(result["p50_s"]),
            "p95_s": _round(result["p95_s"]),
            "p90_s": _round(result["p90_s"]),
            "p99_s": _round(result["p99_s"]),
            "max_s": _round(result["max_s"]),
            "mean_s": _round(result["mean_s"]),
            "delivered_fraction": round(result["delivered_fraction"], 4),
            "targets": {"delivered_fraction": TARGET_DELIVERED, "p95_s": TARGET_P95_S},
            "targets_met": {"delivered_fraction": ok_delivered, "p95_s": ok_p95},
            "ads_in_window": result["ads_in_window"],
            "expected_pairs": result["expected_pairs"],
            "delivered_pairs": result["delivered_pairs"],
            "superseded_pairs": result["superseded_pairs"],
            "ads_reaching_all": result["ads_reaching_all"],
            "non_bootstrap_receivers": {k: _round(nb[k]) for k in ("delivered_fraction", "p50_s", "p95_s")},
            "slowest_receivers": slowest_out,
            "period_s": args.period,
            "window_s": round(w1 - w0, 2),
            "warmup_s": args.warmup,
            "drain_s": args.drain,
            "bootstraps": args.bootstraps,
            "joins": args.joins,
            "join_interval_s": args.join_interval,
            "startup_s": round(startup_s, 1),
            "views_complete_after_s": _round(converged_s, 1),
            "mesh_degree": mesh,
            "mesh_degree_window": mesh_window,
            "subscribed_peers": subscribed,
            "connections": connections,
            "view_live": views,
            "heartbeat_s": {str(k): v for k, v in heartbeats.items()},
            "network_health": health,
            "view_rejected": rejected,
            "view_reject_reasons": dict(reasons),
            "dial_errors": result["dial_errors"],
            "members_died": died,
            "member_cpu_util": round(cpu_util, 3),
            "member_cpu_per_member": per_member_cpu,
            "machine_cpu_shares": shares,
            "machine_busy_before_start": busy_before,
            "loop_lag_s": lag,
            "loadavg_1m": round(load1, 2),
            "windows": [{"others_cpu": (w["shares"] or {}).get("others"),
                         "delivered_fraction": round(w["result"]["delivered_fraction"], 4),
                         "p50_s": _round(w["result"]["p50_s"]), "p95_s": _round(w["result"]["p95_s"])}
                        for w in windows],
            "window_reported": windows.index(chosen) + 1,
            "machine": machine_info(),
            "wall_s": round(wall_s, 1),
        }
        print(json.dumps(summary), flush=True)
        return 0
    finally:
        cleanup.run()


def measure_window(members: list[Member], seconds: float) -> dict:
    """Sleep through one measurement window, sampling the members' and the machine's CPU."""
    w0 = time.time()
    cpu0 = [m.cpu_s() for m in members]
    machine0 = machine_cpu_s()
    w1 = w0 + seconds
    log(f"measurement window open for {seconds:.1f}s")
    time.sleep(max(0.0, w1 - time.time()))
    cpu1 = [m.cpu_s() for m in members]
    machine1 = machine_cpu_s()
    used = [b - a for a, b in zip(cpu0, cpu1) if a is not None and b is not None]
    member_cpu = sum(used)
    by_member = {m.index: (b - a) / seconds for m, a, b in zip(members, cpu0, cpu1) if a is not None and b is not None}
    return {"w0": w0, "w1": w1, "member_cpu": member_cpu, "load": os.getloadavg()[0], "cpu_by_member": by_member,
            "per_member_cpu": spread([round(u / seconds, 3) for u in used]),
            "shares": cpu_breakdown(machine0, machine1, member_cpu)}


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--member":
        sys.exit(member_main(sys.argv[2:]))
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        print(f"interrupted ({str(exc) or 'SIGINT'}); member processes stopped", file=sys.stderr)
        sys.exit(130)
