"""Churn soak on the real SmolLM2, on loopback: providers keep leaving and coming back
while a consumer generates without pause.

    .venv/bin/python bench/soak.py [--minutes 30] [--period 30] [--new-tokens 48] [--standby]

swarm     8 provider processes (`compushare node --blocks ...`): two replicas of each of
          the spans 0:8, 8:15, 15:23 and 23:30. One replica of each span (`a*`) lives
          through the whole run; the other (`b*`) is the one churned, so a span is never
          left without a server by the schedule itself.
churn     every `--period` seconds one event: a running churner stops (alternately
          SIGTERM, a clean leave, and SIGKILL, a crash), or a stopped one starts again
          (the next event waits until it serves). Events go round the spans.
consumer  this process (pipeline.consumer.Consumer, as a user gets it: spot checks,
          direct return, speculation; `--standby` adds standby replicas), generating
          greedily one prompt after another from a fixed list for `--minutes`, each held
          to its reference (the same prompt generated before any churn).
memory    the resident set (VmRSS) of every process alive for the whole run (the 4
          long-lived providers and this consumer) after the references, and at the end;
          `max_rss_growth` is the largest relative growth among them.

Human-readable lines first; the last line is one JSON object:
{"minutes", "generations", "failed", "identical", "max_rss_growth", ...}. Targets:
0 failed, every output identical, growth < 10 %.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
from pathlib import Path

from _common import REPO, finish  # noqa: E402,F401  (this checkout's src/, the shared cache)

import trio  # noqa: E402

from compushare.pipeline.client.consumer import Consumer, RunRequest  # noqa: E402
from compushare.pipeline.client.sampling import SamplingParams  # noqa: E402
from local_swarm import LocalSwarm, running_swarm, vm_rss_mb  # noqa: E402  (bench/local_swarm.py)

MODEL = "smollm2-135m"
SPAN_LIST = ((0, 8), (8, 15), (15, 23), (23, 30))
SPANS = {f"{kind}{index}": span for index, span in enumerate(SPAN_LIST) for kind in ("a", "b")}
CHURNERS = [f"b{index}" for index in range(len(SPAN_LIST))]
PROMPTS = (
    "Name three rivers of Europe and one fact about each.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse.",
    "What is the difference between a list and a tuple in Python?",
)
GENERATION_TIMEOUT_S = 300
RSS_TARGET = 0.10


class Churn:
    """The schedule: stop a running churner, start a stopped one, round the spans."""

    def __init__(self, swarm: LocalSwarm, log) -> None:
        self.swarm, self.log = swarm, log
        self.order = itertools.cycle(CHURNERS)
        self.stopped: str | None = None
        self.kills = itertools.cycle((signal.SIGTERM, signal.SIGKILL))
        self.events: list[dict] = []

    def step(self) -> None:
        if self.stopped is not None:  # start it again, and wait until it serves
            name, self.stopped = self.stopped, None
            began = time.monotonic()
            self.swarm.start(name)
            self.swarm.ready(name)
            self.events.append({"event": "start", "node": name, "ready_s": round(time.monotonic() - began, 2)})
            self.log(f"churn: {name} serves again after {time.monotonic() - began:.1f} s")
            return
        name = next(self.order)
        how = next(self.kills)
        proc = self.swarm.procs[name]
        os.kill(proc.pid, how)
        proc.wait(timeout=30)
        self.stopped = name
        self.events.append({"event": "stop", "node": name, "signal": signal.Signals(how).name})
        self.log(f"churn: {name} ({SPANS[name][0]}:{SPANS[name][1]}) stopped by {signal.Signals(how).name}")


async def churn_loop(churn: Churn, period_s: float, until: float) -> None:
    while time.monotonic() + period_s < until:
        await trio.sleep(period_s)
        await trio.to_thread.run_sync(churn.step)


def rss_of(swarm: LocalSwarm) -> dict[str, float]:
    rss = {name: vm_rss_mb(swarm.procs[name].pid) for name in SPANS if name not in CHURNERS}
    rss["consumer"] = vm_rss_mb(os.getpid())
    return rss


async def run(args, swarm: LocalSwarm, client_dir: Path, log) -> dict:
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    requests = [RunRequest(model=MODEL, prompt=p, params=params, standby=args.standby) for p in PROMPTS]
    rows: list[dict] = []
    async with Consumer.connect(client_dir, tuple(swarm.addrs()), MODEL) as consumer:
        references = []
        for request in requests:
            with trio.fail_after(GENERATION_TIMEOUT_S):
                references.append((await consumer.generate(request)).tokens)
        rss_start = rss_of(swarm)
        log(f"references: {len(references)} prompts x {args.new_tokens} tokens; RSS at start (MB): "
            + ", ".join(f"{k} {v:.0f}" for k, v in rss_start.items()))
        churn = Churn(swarm, log)
        until = time.monotonic() + 60 * args.minutes
        async with trio.open_nursery() as nursery:
            nursery.start_soon(churn_loop, churn, args.period, until)
            for index in itertools.count():
                if time.monotonic() >= until:
                    break
                request, reference = requests[index % len(requests)], references[index % len(requests)]
                began = time.monotonic()
                row = {"index": index, "prompt": index % len(requests)}
                try:
                    with trio.fail_after(GENERATION_TIMEOUT_S):
                        outcome = await consumer.generate(request)
                    row.update(ok=True, identical=outcome.tokens == reference, failovers=len(outcome.failovers),
                               takeovers=outcome.standby_takeovers)
                except Exception as exc:  # a failed generation is the result, not the end of the run
                    row.update(ok=False, identical=False, error=f"{type(exc).__name__}: {exc}"[:300])
                row["seconds"] = round(time.monotonic() - began, 2)
                rows.append(row)
                log(f"generation {index + 1}: {'ok' if row['ok'] else 'FAILED'}"
                    f"{'' if row['identical'] else ' (not identical)'} in {row['seconds']} s"
                    + (f", {row['failovers']} failovers" if row.get("failovers") else "")
                    + (f": {row['error']}" if not row["ok"] else ""))
            nursery.cancel_scope.cancel()
        rss_end = rss_of(swarm)
    growth = {name: (rss_end[name] - rss_start[name]) / rss_start[name] for name in rss_start}
    return {
        "minutes": args.minutes,
        "period_s": args.period,
        "standby": args.standby,
        "generations": len(rows),
        "failed": sum(1 for r in rows if not r["ok"]),
        "identical": all(r["identical"] for r in rows),
        "not_identical": sum(1 for r in rows if r["ok"] and not r["identical"]),
        "failovers": sum(r.get("failovers", 0) for r in rows),
        "standby_takeovers": sum(r.get("takeovers", 0) for r in rows),
        "churn_events": len(churn.events),
        "restart_ready_s_max": max((e["ready_s"] for e in churn.events if e["event"] == "start"), default=None),
        "max_rss_growth": round(max(growth.values()), 4),
        "rss_start_mb": {k: round(v, 1) for k, v in rss_start.items()},
        "rss_end_mb": {k: round(v, 1) for k, v in rss_end.items()},
        "errors": [r["error"] for r in rows if not r["ok"]][:5],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--period", type=float, default=30.0, help="seconds between churn events")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--standby", action="store_true", help="generations keep standby replicas")
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "soak.jsonl"),
                        help="JSON-lines history to append to ('' for none)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below

    def log(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    with running_swarm("compushare-soak-", MODEL, SPANS) as (swarm, client_dir):
        log(f"churned: {', '.join(CHURNERS)}")
        result = trio.run(run, args, swarm, client_dir, log)
    result["targets_met"] = result["failed"] == 0 and result["identical"] and result["max_rss_growth"] < RSS_TARGET
    return finish(result, args.results)


if __name__ == "__main__":
    sys.exit(main())
