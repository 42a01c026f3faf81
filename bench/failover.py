"""Failover on the real SmolLM2, on loopback: early faults, and faults late in a
1,000-token context with and without standby replicas.

    .venv/bin/python bench/failover.py [--early-faults 6] [--long-faults 8] [--seed 1] [--replay fast]

swarm     4 provider processes on 127.0.0.1: two replicas of blocks 0:15 and two of
          15:30 (`compushare node --blocks ...`), and this process as the consumer
          (pipeline.consumer.Consumer: default 5% spot checks, direct return and
          speculation on, as a user gets them).
early     a chat prompt, 32 new tokens, one fault at a random token in 4..20.
long      a 700-token prompt (the start of docs/architecture.md, no chat template)
          then 300 new tokens: 1,000 tokens of context; one fault at a position
          drawn uniformly from 700..1000. Alternately without and with a standby
          (RunRequest.standby: the other replica of each span is fed every step).
faults    into the server currently running a random hop: alternately SIGKILL (the
          process is restarted, and the next generation waits until it serves
          again) and SIGSTOP (a hang; SIGCONT after the generation).
detect    from the fault to the consumer noticing it (connection lost, or the step
          deadline: 1 s + 5 x the hop's usual step latency; with direct return the
          step's other hops answer first, a hop waiting for its push within the
          deadlines of the hops before it).
recovery  from noticing to the next token. Without a standby: planning, a session
          on the replacement, the replay of the span's whole history as it was
          computed (every step a chunk of its original size, rejected drafts rolled
          back as they were: the replacement's KV cache is bit-identical), the rest
          of the step: it grows with the context, one decode step of 15 blocks per
          generated token. With a standby: only the steps it has not seen (one).
replay    `--replay exact` replays as above; `--replay fast` (the default here) asks
          the long generations for RunRequest.fast_replay: the history in one forward
          per request (at most 2,048 tokens), exact within the format's tolerance,
          not bit-identical. The JSON says which (`replay`), and `replay_error` is
          the relative error of blocks 0:15's output after a fast replay of the long
          reference (its 700-token prompt and 300 tokens, embedded) against the same
          steps computed one by one, in this process; `tolerance`: fp32's.
reference one uninterrupted generation of each prompt; `identical`: every faulted
          generation's tokens equal it (a fast replay's included). `prefill_1000_s`: one 1,000-token prefill
          of 15 blocks in this process, what a replay as one prefill would cost
          (exact only with batch-invariant kernels, which torch's CPU kernels are
          not: docs/performance.md).

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

from _common import REPO  # noqa: E402  (this checkout's src/)

import trio  # noqa: E402

from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.proofs.inference import TOLERANCES  # noqa: E402
from compushare.pipeline.client.consumer import Consumer, RunRequest  # noqa: E402
from compushare.pipeline.client.sampling import SamplingParams  # noqa: E402
from local_swarm import LocalSwarm, running_swarm  # noqa: E402  (bench/local_swarm.py)

MODEL = "smollm2-135m"
SPANS = {"a1": (0, 15), "a2": (0, 15), "b1": (15, 30), "b2": (15, 30)}
PROMPT = "Name three rivers of Europe and one fact about each."
FAULT_TOKENS = (4, 20)
LONG_PROMPT_TOKENS = 700
LONG_NEW_TOKENS = 300
TARGETS = {"detect_p95_s": 2.0, "recovery_p95_s": 1.0, "recovery_nostandby_p95_s": 3.0}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))], 3)


async def faulted(consumer, swarm: LocalSwarm, request: RunRequest, kind: str, at_token: int, hop_index: int,
                  reference: list[int]) -> dict:
    """One generation with one fault at its `at_token`-th token; its row."""
    route: list = []
    times: list[float] = []
    fault: dict = {}

    def on_token(_token) -> None:
        times.append(time.time())
        if len(times) == at_token and not fault:
            victim = swarm.name_of(route[-1][hop_index].peer_id)
            fault.update(name=victim, at=time.time())
            os.kill(swarm.procs[victim].pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)

    try:
        with trio.fail_after(600):
            outcome = await consumer.generate(request, on_route=route.append, on_token=on_token)
    finally:
        if fault and kind == "hang":
            os.kill(swarm.procs[fault["name"]].pid, signal.SIGCONT)
    event = next((f for f in outcome.failovers if f.noticed >= fault["at"]), None)
    row = {"kind": kind, "at_token": at_token, "identical": outcome.tokens == reference, "detect_s": None,
           "recovery_s": None, "standby": request.standby, "takeovers": outcome.standby_takeovers}
    if event is not None:
        next_token = next(t for t in times if t >= event.noticed)
        row.update(span=f"{event.start}:{event.end}", detect_s=event.noticed - fault["at"],
                   recovery_s=next_token - event.noticed, reason=event.reason, failovers=len(outcome.failovers))
    if kind == "kill":  # back to two replicas before the next fault
        swarm.procs[fault["name"]].wait(timeout=10)
        swarm.start(fault["name"])
        await trio.to_thread.run_sync(swarm.ready, fault["name"])
    return row


def show(label: str, row: dict) -> None:
    if row["recovery_s"] is None:
        print(f"{label} {row['kind']}: no failover was recorded (identical {row['identical']})", flush=True)
    else:
        print(f"{label} {row['kind']} {row['span']} at token {row['at_token']}: detect {row['detect_s']:.3f} s "
              f"({row['reason']}), recovery {row['recovery_s']:.3f} s, standby takeovers {row['takeovers']}, "
              f"identical {row['identical']}", flush=True)


def long_prompt(tokenizer) -> list[int]:
    text = (REPO / "docs" / "architecture.md").read_text()
    return tokenizer(text)["input_ids"][:LONG_PROMPT_TOKENS]


def prefill_seconds(model_path: Path, ids: list[int], prompt_tokens: int) -> tuple[float, float]:
    """One prefill of `ids` through blocks 0:15, here (1 thread): its seconds, and
    its output's relative error against the prompt then each token one by one (what
    a fast replay computes against the steps as first computed)."""
    import torch

    from compushare.model.blocks import SpanRunner
    from compushare.model.head import ConsumerHead
    from compushare.proofs.inference import relative_error

    torch.set_num_threads(1)
    runner = SpanRunner.load(model_path, 0, 15)
    hidden = ConsumerHead.load(model_path).embed_tokens(ids).view(1, len(ids), -1)
    began = time.perf_counter()
    fast = runner.forward(hidden, runner.new_cache(), 0)
    seconds = time.perf_counter() - began
    cache = runner.new_cache()
    steps = [runner.forward(hidden[:, :prompt_tokens], cache, 0)]
    steps += [runner.forward(hidden[:, i:i + 1], cache, i) for i in range(prompt_tokens, len(ids))]
    return seconds, relative_error(fast.numpy(), torch.cat(steps, dim=1).numpy())


async def run(args, swarm: LocalSwarm, client_dir: Path) -> dict:
    rng = random.Random(args.seed)
    early = RunRequest(model=MODEL, prompt=PROMPT, params=SamplingParams(max_new_tokens=args.new_tokens,
                                                                         stop_at_eos=False))
    rows: dict[str, list[dict]] = {"early": [], "long": [], "long_standby": []}
    async with Consumer.connect(client_dir, tuple(swarm.addrs()), MODEL) as consumer:
        prompt_ids = long_prompt(consumer.tokenizer)
        long = RunRequest(model=MODEL, prompt=prompt_ids, chat_template=False, fast_replay=args.replay == "fast",
                          params=SamplingParams(max_new_tokens=LONG_NEW_TOKENS, stop_at_eos=False))
        reference = await consumer.generate(early)
        long_reference = await consumer.generate(long)
        print(f"reference: {len(reference.tokens)} tokens at {reference.decode_tok_s:.1f} tok/s; long: "
              f"{len(prompt_ids)} + {len(long_reference.tokens)} tokens at {long_reference.decode_tok_s:.1f} tok/s",
              flush=True)
        speeds: dict[float, list[float]] = {0.0: [], consumer.spot_check_rate: []}
        for _ in range(3):
            for rate in speeds:
                consumer.spot_check_rate = rate
                outcome = await consumer.generate(early)
                speeds[rate].append(outcome.decode_tok_s)
        consumer.spot_check_rate = max(speeds)
        spot_ratio = statistics.median(speeds[max(speeds)]) / statistics.median(speeds[0.0])
        print(f"decode with {max(speeds):.0%} spot checks / without: {spot_ratio:.3f} "
              f"({statistics.median(speeds[max(speeds)]):.2f} / {statistics.median(speeds[0.0]):.2f} tok/s)",
              flush=True)
        for index in range(args.early_faults):
            kind = "kill" if index % 2 == 0 else "hang"
            row = await faulted(consumer, swarm, early, kind, rng.randint(*FAULT_TOKENS), rng.randrange(2),
                                reference.tokens)
            rows["early"].append(row)
            show(f"early {index + 1:2d}", row)
        for index in range(2 * args.long_faults):
            standby = index % 2 == 1
            kind = "kill" if (index // 2) % 2 == 0 else "hang"
            request = dataclasses.replace(long, standby=standby)
            row = await faulted(consumer, swarm, request, kind, rng.randint(1, LONG_NEW_TOKENS - 1),
                                rng.randrange(2), long_reference.tokens)
            rows["long_standby" if standby else "long"].append(row)
            show(f"long {'standby' if standby else 'alone  '} {index // 2 + 1:2d}", row)
    prefill_s, replay_error = await trio.to_thread.run_sync(
        prefill_seconds, consumer_model_path(client_dir), prompt_ids + long_reference.tokens[:LONG_NEW_TOKENS],
        LONG_PROMPT_TOKENS)
    every = [r for group in rows.values() for r in group]
    detects = [r["detect_s"] for r in every if r["detect_s"] is not None]

    def recoveries(group: str) -> list[float]:
        return [r["recovery_s"] for r in rows[group] if r["recovery_s"] is not None]

    result = {
        "model": MODEL,
        "faults": len(every),
        "failovers": len(detects),
        "identical": all(r["identical"] for r in every) and len(detects) == len(every),
        "context_tokens": LONG_PROMPT_TOKENS + LONG_NEW_TOKENS,
        "detect_p50_s": round(statistics.median(detects), 3) if detects else None,
        "detect_p95_s": pct(detects, 0.95),
        "recovery_p95_s": pct(recoveries("long_standby"), 0.95),
        "recovery_p50_s": pct(recoveries("long_standby"), 0.5),
        "recovery_nostandby_p95_s": pct(recoveries("long"), 0.95),
        "recovery_nostandby_p50_s": pct(recoveries("long"), 0.5),
        "recovery_early_p95_s": pct(recoveries("early"), 0.95),
        "standby_takeovers": sum(r["takeovers"] for r in rows["long_standby"]),
        "prefill_1000_s": round(prefill_s, 3),
        "replay": args.replay,
        "replay_error": float(f"{replay_error:.3g}"),
        "tolerance": TOLERANCES["fp32"],
        "early_new_tokens": args.new_tokens,
        "fault_tokens": list(FAULT_TOKENS),
        "reference_tok_s": round(reference.decode_tok_s, 2),
        "long_reference_tok_s": round(long_reference.decode_tok_s, 2),
        "spot_check_speed_ratio": round(spot_ratio, 3),
        "rows": rows,
    }
    result["targets_met"] = bool(result["identical"]) and all(
        result[key] is not None and result[key] <= limit for key, limit in TARGETS.items())
    return result


def consumer_model_path(client_dir: Path) -> Path:
    return resolve_model(MODEL, client_dir).path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--early-faults", type=int, default=6)
    parser.add_argument("--long-faults", type=int, default=8, help="faults late in a 1,000-token context, "
                                                                    "each with and without a standby")
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens of the early generations")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--replay", choices=("fast", "exact"), default="fast",
                        help="how a failover without a standby replays the long generations' history")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("compushare.pipeline.client.planner").setLevel(logging.INFO)  # why no standby
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    with running_swarm("compushare-failover-", MODEL, SPANS) as (swarm, client_dir):
        result = trio.run(run, args, swarm, client_dir)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
