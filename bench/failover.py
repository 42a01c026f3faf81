"""Failover: 20 faults injected into generations on the real SmolLM2, on loopback.

    .venv/bin/python bench/failover.py [--failovers 20] [--new-tokens 32]

swarm     4 provider processes on 127.0.0.1: two replicas of blocks 0:15 and two of
          15:30 (`compushare node --blocks ...`), and this process as the consumer
          (pipeline.consumer.Consumer: default 5% spot checks, chat template).
reference one uninterrupted greedy generation of the prompt through the swarm.
faults    each generation injects one fault, at a random token in 4..20, into the
          server currently running a random hop: alternately SIGKILL (then the process
          is restarted, and the next generation waits until it serves again) and
          SIGSTOP (a hang; SIGCONT after the generation).
detect    from the fault to the consumer noticing it (connection lost, or the step
          deadline: 1 s + 5 × the hop's usual step latency).
recovery  from noticing to the next token: planning from the candidates already at
          hand, a session on the replacement, the replay of the span's history chunk
          by chunk (so the replacement's KV cache is bit-identical), the rest of the
          step. It grows with the history: one decode step of 15 blocks per token.
identical every faulted generation's tokens equal the reference's.
spot cost decode tok/s with the default 5% spot checks over tok/s without, 3
          generations each, interleaved, no faults (a check waits for the second
          server's answer: the steps it missed, batched, plus this one).

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    try:
        import compushare  # noqa: F401  (installed editable in the venv)
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("COMPUSHARE_CACHE", str(REPO / ".cache" / "compushare"))

import trio  # noqa: E402

from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.pipeline.client.consumer import Consumer, RunRequest  # noqa: E402
from compushare.pipeline.client.sampling import SamplingParams  # noqa: E402
from local_swarm import LocalSwarm  # noqa: E402  (bench/local_swarm.py)

MODEL = "smollm2-135m"
SPANS = {"a1": (0, 15), "a2": (0, 15), "b1": (15, 30), "b2": (15, 30)}
PROMPT = "Name three rivers of Europe and one fact about each."
FAULT_TOKENS = (4, 20)
TARGETS = {"detect_p95_s": 2.0, "recovery_p95_s": 1.0}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))], 3)


async def run(args, swarm: LocalSwarm, client_dir: Path) -> dict:
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    request = RunRequest(model=MODEL, prompt=PROMPT, params=params)
    rng = random.Random(args.seed)
    rows = []
    async with Consumer.connect(client_dir, tuple(swarm.addrs()), MODEL) as consumer:
        reference = await consumer.generate(request)
        print(f"reference: {len(reference.tokens)} tokens at {reference.decode_tok_s:.1f} tok/s: "
              f"{reference.text[:60]!r}...", flush=True)
        speeds: dict[float, list[float]] = {0.0: [], consumer.spot_check_rate: []}
        for _ in range(3):
            for rate in speeds:
                consumer.spot_check_rate = rate
                outcome = await consumer.generate(request)
                speeds[rate].append(outcome.decode_tok_s)
        consumer.spot_check_rate = max(speeds)
        spot_ratio = statistics.median(speeds[max(speeds)]) / statistics.median(speeds[0.0])
        print(f"decode with {max(speeds):.0%} spot checks / without: {spot_ratio:.3f} "
              f"({statistics.median(speeds[max(speeds)]):.2f} / {statistics.median(speeds[0.0]):.2f} tok/s)",
              flush=True)
        for index in range(args.failovers):
            kind = "kill" if index % 2 == 0 else "hang"
            at_token = rng.randint(*FAULT_TOKENS)
            hop_index = rng.randrange(2)
            route: list = []
            times: list[float] = []
            fault: dict = {}

            def on_token(_token, route=route, times=times, fault=fault, kind=kind, at_token=at_token,
                         hop_index=hop_index):
                times.append(time.time())
                if len(times) == at_token and not fault:
                    victim = swarm.name_of(route[-1][hop_index].peer_id)
                    fault.update(name=victim, at=time.time())
                    os.kill(swarm.procs[victim].pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)

            try:
                with trio.fail_after(300):
                    outcome = await consumer.generate(request, on_route=route.append, on_token=on_token)
            finally:
                if fault and kind == "hang":
                    os.kill(swarm.procs[fault["name"]].pid, signal.SIGCONT)
            event = next((f for f in outcome.failovers if f.noticed >= fault["at"]), None)
            identical = outcome.tokens == reference.tokens
            if event is None:
                print(f"{index + 1:2d} {kind}: no failover was recorded", flush=True)
                rows.append({"kind": kind, "identical": identical, "detect_s": None, "recovery_s": None})
            else:
                next_token = next(t for t in times if t >= event.noticed)
                row = {"kind": kind, "span": f"{event.start}:{event.end}", "at_token": at_token,
                       "identical": identical, "detect_s": event.noticed - fault["at"],
                       "recovery_s": next_token - event.noticed, "reason": event.reason,
                       "failovers": len(outcome.failovers)}
                rows.append(row)
                print(f"{index + 1:2d} {kind} {row['span']} at token {at_token}: detect {row['detect_s']:.3f} s "
                      f"({event.reason}), recovery {row['recovery_s']:.3f} s, identical {identical}", flush=True)
            if kind == "kill":  # back to two replicas before the next fault
                name = fault["name"]
                swarm.procs[name].wait(timeout=10)
                swarm.start(name)
                await trio.to_thread.run_sync(swarm.ready, name)
    detects = [r["detect_s"] for r in rows if r["detect_s"] is not None]
    recoveries = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    result = {
        "model": MODEL,
        "failovers": len(recoveries),
        "faults": len(rows),
        "identical": all(r["identical"] for r in rows) and len(recoveries) == len(rows),
        "detect_p50_s": round(statistics.median(detects), 3) if detects else None,
        "detect_p95_s": pct(detects, 0.95),
        "detect_kill_p95_s": pct([r["detect_s"] for r in rows if r["kind"] == "kill" and r["detect_s"]], 0.95),
        "detect_hang_p95_s": pct([r["detect_s"] for r in rows if r["kind"] == "hang" and r["detect_s"]], 0.95),
        "recovery_p50_s": round(statistics.median(recoveries), 3) if recoveries else None,
        "recovery_p95_s": pct(recoveries, 0.95),
        "new_tokens": args.new_tokens,
        "fault_tokens": list(FAULT_TOKENS),
        "reference_tok_s": round(reference.decode_tok_s, 2),
        "spot_check_speed_ratio": round(spot_ratio, 3),
    }
    result["targets_met"] = bool(result["identical"]) and all(
        result[key] is not None and result[key] <= limit for key, limit in TARGETS.items())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failovers", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    with tempfile.TemporaryDirectory(prefix="compushare-failover-") as tmp:
        root = Path(tmp)
        swarm = LocalSwarm(root, MODEL, SPANS)
        try:
            client_dir = root / "client"
            resolve_model(MODEL, client_dir)  # converts SmolLM2 once into the shared cache
            swarm.start_all()
            print(f"swarm: {', '.join(f'{n} {s[0]}:{s[1]}' for n, s in SPANS.items())}", flush=True)
            result = trio.run(run, args, swarm, client_dir)
        finally:
            swarm.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
