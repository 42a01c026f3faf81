"""How fast this node decodes one block of a model: a short benchmark, cached on disk.

The rate is per block (decode steps per second through one block), so a node can
estimate its throughput for any span: rate / span length. Measuring takes about a
second, so results are kept in `<cache dir>/selfbench.json`, keyed by everything
that changes them: the model, torch's thread count and the hardware.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..hardware import detect_hardware
from .families import read_config

if TYPE_CHECKING:  # the torch runtime's modules load transformers: imported when used
    from .blocks import SpanRunner

log = logging.getLogger(__name__)

CACHE_FILE = "selfbench.json"
CACHE_VERSION = 1
PREFILL_TOKENS = 16


def measure_block_rate(model_dir: Path, *, blocks: int = 2, steps: int = 8, warmup: int = 2,
                       threads: int | None = None, slowdown: float = 1.0, device: str = "cpu",
                       random_span: Callable[[Path, int, int], Any] | None = None) -> float:
    """Decode steps per second for ONE block: build `blocks` consecutive blocks (0:blocks,
    or fewer if the model is smaller) with random weights, prefill a short random hidden state (16 tokens),
    then time `steps` single-token decode steps after `warmup` untimed ones; return
    steps_per_second * blocks (the per-block rate). Runs torch in the calling thread:
    callers use trio.to_thread. `threads` sets torch's thread count for the run (it is
    process-wide, so it is restored afterwards); None keeps the current one. `device`:
    where the blocks compute, as the node's span will (each step returns to the host,
    so its time includes the device's). `random_span(model_dir, start, end)`: the
    runtime's random span when it is not torch's (spans.ggml.load.random_ggml_span)."""
    if blocks < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need blocks >= 1, steps >= 1, warmup >= 0; got {blocks}, {steps}, {warmup}")
    blocks = min(blocks, read_config(model_dir)["num_hidden_layers"])
    # Random weights of the model's shapes: the node may not hold any block yet (it
    # fetches its span after choosing it), and the values do not change the speed.
    if random_span is None:
        from .blocks import SpanRunner

        random_span = functools.partial(SpanRunner.random, device=device)
    runner = random_span(model_dir, 0, blocks)
    runner.slowdown = slowdown
    previous_threads = torch.get_num_threads()
    cache = None
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            # A private generator: the benchmark must not move the global RNG that sampling uses.
            generator = torch.Generator().manual_seed(0)
            prompt = torch.randn(1, PREFILL_TOKENS, runner.hidden_size, generator=generator)
            token = torch.randn(1, 1, runner.hidden_size, generator=generator)
            cache = runner.new_cache()
            runner.forward(prompt, cache, 0)
            step_s = time_decode_steps(runner, token, cache, PREFILL_TOKENS, warmup=warmup, steps=steps)
    finally:
        torch.set_num_threads(previous_threads)
        if hasattr(runner, "close"):  # a ggml span's buffers are C memory: given back now, before the span loads
            cache = None
            runner.close()
    return blocks / step_s


def time_decode_steps(runner: SpanRunner, token: torch.Tensor, cache, position: int, *, warmup: int,
                      steps: int) -> float:
    """Seconds per single-token decode step of `runner` on `cache` (which holds
    `position` tokens), over `steps` timed steps after `warmup` untimed ones. Each
    step's output comes back to the host, so a device's time is in it."""
    for _ in range(warmup):
        runner.forward(token, cache, position)
        position += 1
    began = time.perf_counter()
    for _ in range(steps):
        runner.forward(token, cache, position)
        position += 1
    return (time.perf_counter() - began) / steps


def cache_key(model_id: str, threads: int, device: str = "cpu", runtime: str = "torch") -> str:
    hardware = detect_hardware()
    on = "" if device == "cpu" else f"|device={device}"
    on += "" if runtime == "torch" else f"|runtime={runtime}"
    return f"{model_id}|threads={threads}|cpu={hardware.cpu_cores}|gpu={hardware.gpu}|torch={torch.__version__}{on}"


def _read_entries(path: Path) -> dict:
    """The cached rates, or {} when the file is missing, unreadable or malformed."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # ValueError covers bad JSON and bad UTF-8
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("rates"), dict):
        return {}
    return {key: rate for key, rate in data["rates"].items() if _valid_rate(rate)}


def _valid_rate(value) -> bool:
    return type(value) is float and math.isfinite(value) and value > 0


def _write_entries(path: Path, rates: dict) -> None:
    """Replace the file atomically: a reader sees the old or the new file, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{CACHE_FILE}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump({"version": CACHE_VERSION, "rates": rates}, handle, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_block_rate(model, cache_dir: Path, *, threads: int, measure=measure_block_rate, device: str = "cpu",
                      runtime: str = "torch") -> float:
    """Look up `<cache_dir>/selfbench.json` keyed by model.model_id + torch thread count +
    a hardware fingerprint (cpu_cores, gpu, torch version); measure and store on a miss.
    A corrupt or unreadable cache file is ignored (re-measured), never fatal."""
    path = Path(cache_dir) / CACHE_FILE
    key = cache_key(model.model_id, threads, device, runtime)
    rates = _read_entries(path)
    if key in rates:
        return rates[key]
    rate = float(measure(model.path, threads=threads, device=device))
    if not _valid_rate(rate):
        raise ValueError(f"self-benchmark of {model.model_id} gave an invalid rate {rate!r}")
    # Re-read just before writing so entries another node added meanwhile survive
    # (a simultaneous writer can still win the race; its loss is one re-measurement).
    rates = _read_entries(path) | {key: rate}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_entries(path, rates)
    except OSError as exc:
        log.warning("could not save the self-benchmark to %s: %s", path, exc)
    return rate
