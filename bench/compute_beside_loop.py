"""A forward pass in a worker thread beside a busy trio loop: what the GIL costs it.

    .venv/bin/python bench/compute_beside_loop.py [--rounds 12] [--busy-ms 0.4 --period-ms 2.5]

A node runs prefills and long steps (SmolLM2-135M here: blocks 10:20, fp32, one
torch thread) in a worker thread while its trio loop handles the network in pure
Python (py-libp2p); short decode steps run on the loop itself
(pipeline/server/compute.Compute.runs_inline). Every torch op releases the GIL; at CPython's
default switch interval (5 ms) the loop, once it holds the GIL, keeps it for its
whole burst and the threaded forward waits. This bench times the same one-token
step in a worker thread side by side, in one process, in interleaved blocks of 8
steps:

  idle      the loop has nothing to do (the ideal);
  busy      the loop runs BUSY_MS of Python every PERIOD_MS (a node handling traffic),
            at the default switch interval and at the one a node sets
            (compushare.app.node.COMPUTE_SWITCH_INTERVAL_S).

Each figure is the median step time relative to `idle` at the default interval;
interleaving cancels this machine's drift. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: E402, F401  (this checkout's src/)

import torch  # noqa: E402
import trio  # noqa: E402

from compushare.model.blocks import SpanRunner  # noqa: E402
from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.app.node import COMPUTE_SWITCH_INTERVAL_S  # noqa: E402

MODEL = "smollm2-135m"
SPAN = (10, 20)
BLOCK_STEPS = 8
MAX_POSITION = 200  # the cache is rolled back to the prompt beyond this


def measure(runner: SpanRunner, rounds: int, busy_s: float, period_s: float) -> dict[str, list[float]]:
    default = sys.getswitchinterval()
    configs = {
        "idle_default": (False, default),
        "busy_default": (True, default),
        "busy_node": (True, COMPUTE_SWITCH_INTERVAL_S),
        "idle_node": (False, COMPUTE_SWITCH_INTERVAL_S),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    loop_busy = False

    async def network_like_work() -> None:
        while True:
            await trio.sleep(period_s)
            if loop_busy:
                began = time.perf_counter()
                while time.perf_counter() - began < busy_s:
                    pass

    async def main() -> None:
        nonlocal loop_busy
        prompt = 8
        cache = runner.new_cache()
        runner.forward(torch.randn(1, prompt, runner.hidden_size), cache, 0)
        position = prompt
        async with trio.open_nursery() as nursery:
            nursery.start_soon(network_like_work)
            for _ in range(rounds):
                for name, (busy, interval) in configs.items():
                    loop_busy = busy
                    sys.setswitchinterval(interval)
                    for _ in range(BLOCK_STEPS):
                        if position >= MAX_POSITION:
                            runner.truncate(cache, prompt)
                            position = prompt
                        hidden = torch.randn(1, 1, runner.hidden_size)
                        began = time.perf_counter()
                        await trio.to_thread.run_sync(runner.forward, hidden, cache, position)
                        times[name].append(time.perf_counter() - began)
                        position += 1
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        sys.setswitchinterval(default)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--busy-ms", type=float, default=0.4, help="Python work per loop wake-up")
    parser.add_argument("--period-ms", type=float, default=2.5, help="time between loop wake-ups")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="compushare-beside-loop-") as tmp:
        model = resolve_model(MODEL, Path(tmp))
        runner = SpanRunner.load(model.path, *SPAN)
    times = measure(runner, args.rounds, args.busy_ms / 1000, args.period_ms / 1000)
    medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
    base = medians["idle_default"]
    for name, ms in medians.items():
        print(f"{name:13s} {ms:6.2f} ms per step  x{ms / base:.3f}")
    result = {
        "step_ms": {name: round(ms, 3) for name, ms in medians.items()},
        "busy_default_vs_idle": round(medians["busy_default"] / base, 3),
        "busy_node_vs_idle": round(medians["busy_node"] / base, 3),
        "idle_node_vs_idle": round(medians["idle_node"] / base, 3),
        "switch_interval_s": {"default": sys.getswitchinterval(), "node": COMPUTE_SWITCH_INTERVAL_S},
        "loop_duty": round(args.busy_ms / args.period_ms, 3),
        "steps_per_config": len(times["idle_default"]),
        "span": list(SPAN),
        "model": MODEL,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
