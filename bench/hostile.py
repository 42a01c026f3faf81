"""Hostile load: an honest consumer generating on the real SmolLM2 while 4 attacker
identities attack one server of its chain at their per-peer limits.

    .venv/bin/python bench/hostile.py [--quiet-s 60] [--attack-s 300] [--new-tokens 32]

swarm     3 provider processes on 127.0.0.1 (blocks 0:10, 10:20, 20:30) and this
          process as the consumer (pipeline.consumer.Consumer, chat template, greedy),
          generating one prompt again and again for the whole run; and a bystander,
          a 4th provider of 10:20 that the consumer never routes through.
phases    quiet (--quiet-s), elsewhere (--reference-s), attack (--attack-s), quiet
          again (--after-s, 3 minutes: caches of the attack's traffic expire within 2). "elsewhere" is the machine's own limit: the same
          attackers against the bystander. They and every node share this machine's
          CPUs, so an attack anywhere slows the honest generation; the attack on its
          own server is judged beside that.
attackers 4 libp2p hosts, each with a fresh Ed25519 identity, in a process of their
          own (python -m hostile): against the bystander in the elsewhere phase, the
          server of blocks 10:20 on the route in the attack phase. Each runs every
          attack kind (--kinds) at once, at the limits a node grants one peer: the KV
          hog (sessions as large as the server grants, 1,024-token prefills back to back
          on 4 streams: hostile/infer.py), Sybil ads and DHT records (hostile/sybil.py,
          sybil_records.py), receive-window overruns and parked streams
          (hostile/window.py). `attacks` counts what they did.
identical every generation's tokens equal the first one's (quiet) generation.
failed    generations that raised.
tok/s     the median decode tok/s of the generations that ran in the attack phase
          over that of the first quiet phase (and of the elsewhere phase over it).
rss       the attacked node's VmRSS (/proc), sampled every second: the mean over the
          last minute of the final quiet phase minus the mean over the last minute of
          the first (no allocator trim); rss_after_attack_mb is the final phase's first
          minute.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO  # noqa: E402  (this checkout's src/)
sys.path.insert(0, str(REPO / "tools"))

import trio  # noqa: E402

from compushare.config import STATE_FILE  # noqa: E402
from compushare.errors import CompushareError  # noqa: E402
from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.pipeline.client.consumer import Consumer, RunRequest  # noqa: E402
from compushare.pipeline.client.sampling import SamplingParams  # noqa: E402
from local_swarm import LocalSwarm, cpu_seconds, vm_rss_mb  # noqa: E402  (bench/local_swarm.py)

MODEL = "smollm2-135m"
SPANS = {"a": (0, 10), "b": (10, 20), "c": (20, 30), "d": (10, 20)}
TARGET = "b"
BYSTANDER = "d"
ATTACKERS = 4
PROMPT = "Name three rivers of Europe and one fact about each."
RSS_WINDOW_S = 60  # RSS samples (one a second) averaged: the first quiet phase's last minute, the final one's
TARGETS = {"failed": 0, "tok_s_under_attack_vs_quiet": 0.5, "rss_growth_mb": 50.0}


class Attackers:
    """ATTACKERS identities in a process of their own (python -m hostile, tools/hostile)
    against one node, for one phase: their CPU stays off this process's GIL, which
    the consumer being measured needs. Always ended (SIGTERM, then SIGKILL) by pid."""

    def __init__(self, root: Path, victim: str, model_id: str, kinds: str, name: str) -> None:
        self.counts_file = root / f"attacks-{name}.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tools"),
                                                                       os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hostile", "--state", str(root / victim / STATE_FILE), "--model-id", model_id,
             "--attackers", str(ATTACKERS), "--kinds", kinds, "--counts", str(self.counts_file)],
            env=env, start_new_session=True)

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        with contextlib.suppress(FileNotFoundError, ValueError):
            return json.loads(self.counts_file.read_text())
        return {}


async def run(args, swarm: LocalSwarm, client_dir: Path) -> dict:
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    request = RunRequest(model=MODEL, prompt=PROMPT, params=params)
    pid = swarm.procs[TARGET].pid
    phases = [("quiet", args.quiet_s), ("elsewhere", args.reference_s), ("attack", args.attack_s),
              ("quiet_after", args.after_s)]
    victims = {"elsewhere": BYSTANDER, "attack": TARGET}
    speeds: dict[str, list[float]] = {name: [] for name, _ in phases}
    rss: dict[str, list[float]] = {name: [] for name, _ in phases}
    counts: dict[str, dict] = {}
    cpu_share: dict[str, float] = {}  # the attacked node's CPU seconds per second, per phase
    reference, failed, identical, generations = None, 0, True, 0
    phase = {"name": "quiet"}

    async def sample_rss():
        while True:
            rss[phase["name"]].append(vm_rss_mb(pid))
            await trio.sleep(1.0)

    async with Consumer.connect(client_dir, tuple(swarm.addrs()), MODEL) as consumer, \
            trio.open_nursery() as nursery:
        consumer.spot_check_rate = 0.0  # the bystander is no verifier: nothing to check with
        bystander, excluded = swarm.states[BYSTANDER]["peer_id"], consumer.penalties.excluded
        consumer.penalties.excluded = lambda now: excluded(now) | {bystander}  # never on the route
        nursery.start_soon(sample_rss)
        model_id = consumer.model.model_id
        for name, seconds in phases:
            phase["name"] = name
            print(f"phase {name}: {seconds:.0f} s", flush=True)
            attackers = Attackers(swarm.root, victims[name], model_id, args.kinds, name) if name in victims else None
            cpu_before, began = cpu_seconds(pid), time.monotonic()
            try:
                ends = time.monotonic() + seconds
                while time.monotonic() < ends:
                    generations += 1
                    outcome = None
                    try:
                        with trio.fail_after(300):
                            outcome = await consumer.generate(request)
                    except* (CompushareError, trio.TooSlowError) as group:
                        failed += 1
                        print(f"  generation {generations} failed: {group.exceptions[0]}", flush=True)
                    if outcome is None:
                        continue
                    if reference is None:
                        reference = outcome.tokens
                    same = outcome.tokens == reference
                    identical = identical and same
                    speeds[name].append(outcome.decode_tok_s)
                    print(f"  {name} generation {generations}: {outcome.decode_tok_s:.2f} tok/s, first token "
                          f"{outcome.first_token_s:.2f} s, {len(outcome.failovers)} failovers, identical {same}; "
                          f"attacked node RSS {rss[name][-1] if rss[name] else 0:.0f} MB", flush=True)
            finally:
                cpu_share[name] = round((cpu_seconds(pid) - cpu_before) / (time.monotonic() - began), 2)
                if attackers is not None:
                    counts[name] = attackers.stop()
                    print(f"  attacks: {counts[name]}", flush=True)
        nursery.cancel_scope.cancel()
    quiet = statistics.median(speeds["quiet"]) if speeds["quiet"] else 0.0
    attacked = statistics.median(speeds["attack"]) if speeds["attack"] else 0.0
    elsewhere = statistics.median(speeds["elsewhere"]) if speeds["elsewhere"] else 0.0
    result = {
        "model": MODEL,
        "generations": generations,
        "failed": failed,
        "identical": identical and reference is not None,
        "tok_s_quiet": round(quiet, 2),
        "tok_s_under_attack": round(attacked, 2),
        "tok_s_quiet_after": round(statistics.median(speeds["quiet_after"]), 2) if speeds["quiet_after"] else 0.0,
        "tok_s_under_attack_vs_quiet": round(attacked / quiet, 3) if quiet else 0.0,
        "rss_first_quiet_mb": round(statistics.mean(rss["quiet"]), 1),
        "rss_attack_max_mb": round(max(rss["attack"], default=0.0), 1),
        "rss_final_quiet_mb": round(statistics.mean(rss["quiet_after"][-RSS_WINDOW_S:]), 1),
        "rss_growth_mb": round(statistics.mean(rss["quiet_after"][-RSS_WINDOW_S:])
                               - statistics.mean(rss["quiet"][-RSS_WINDOW_S:]), 1),
        "rss_after_attack_mb": round(statistics.mean(rss["quiet_after"][:RSS_WINDOW_S]), 1),
        "attacks": counts.get("attack", {}),
        "attacked_node_cpu_per_s": cpu_share,
        "tok_s_attack_elsewhere": round(elsewhere, 2),
        "machine_ref_tok_s_attack_elsewhere_vs_quiet": round(elsewhere / quiet, 3) if quiet else 0.0,
        "under_attack_vs_attack_elsewhere": round(attacked / elsewhere, 3) if elsewhere else 0.0,
        "attacks_elsewhere": counts.get("elsewhere", {}),
        "attack_kinds": sorted(args.kinds.split(",")),
        "attackers": ATTACKERS,
        "quiet_s": args.quiet_s,
        "after_s": args.after_s,
        "attack_s": args.attack_s,
        "reference_s": args.reference_s,
    }
    result["targets_met"] = (result["failed"] == TARGETS["failed"] and result["identical"]
                             and result["tok_s_under_attack_vs_quiet"] >= TARGETS["tok_s_under_attack_vs_quiet"]
                             and result["rss_growth_mb"] <= TARGETS["rss_growth_mb"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet-s", type=float, default=60.0)
    parser.add_argument("--attack-s", type=float, default=300.0)
    parser.add_argument("--after-s", type=float, default=180.0,
                        help="the final quiet phase; RSS growth is taken over its last minute")
    parser.add_argument("--kinds", default="kv_hog,sybil,window", help="attack kinds, comma-separated")
    parser.add_argument("--reference-s", type=float, default=120.0,
                        help="the machine's reference: the same attack on a bystander off the route")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    with tempfile.TemporaryDirectory(prefix="compushare-hostile-") as tmp:
        root = Path(tmp)
        swarm = LocalSwarm(root, MODEL, SPANS)
        try:
            client_dir = root / "client"
            resolve_model(MODEL, client_dir)  # converts SmolLM2 once into the shared cache
            swarm.start_all()
            print(f"swarm: {', '.join(f'{n} {s[0]}:{s[1]}' for n, s in SPANS.items())}; attacked: {TARGET}",
                  flush=True)
            result = trio.run(run, args, swarm, client_dir)
        finally:
            swarm.close()
            log = root / TARGET / "node.log"
            if log.exists():  # what the attacked node said about the attacks, for the record
                lines = log.read_text(errors="replace").splitlines()
                print(f"attacked node log: {len(lines)} lines; last 15:", *lines[-15:], sep="\n  ")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
