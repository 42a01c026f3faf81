"""Pipeline overhead: a 3-process swarm against the same span code in one process.

    .venv/bin/python bench/pipeline_overhead.py [--trials 3] [--tokens 64] [--format q4]

On SmolLM2-135M (30 blocks, fp32 everywhere, the wire included, one torch thread in
every process) this measures greedy decode speed four ways:

  swarm  3 node processes on 127.0.0.1 serving blocks 0:10, 10:20, 20:30, driven by
         a libp2p client in this process through the real consumer loop
         (pipeline.generate.generate over pipeline.client.open_chain);
  local  three SpanRunner objects (0:10, 10:20, 20:30) + ConsumerHead in this
         process: the same span code, no network;
  hf     transformers' AutoModelForCausalLM.generate on the same weights.
  ring   the same three spans in three worker processes chained by pipes (raw fp32
         bytes, no network stack), the head in this process: what splitting the
         spans into processes costs on this machine before any networking (each
         process idles between its steps, on 2 vCPUs, and loses its warm caches).
         ring/local is the ceiling for any 3-process pipeline here; swarm/ring is
         what the network stack costs on top.

Timing covers the decode only: prefill, model loading and start-up are excluded. A
"decode step" feeds the previous token through all 30 blocks and picks the next one
(argmax). One step turns the prefill's output into token 0; then DECODE_TOKENS steps
produce tokens 1..DECODE_TOKENS, and only those steps are timed:
tok/s = DECODE_TOKENS / (time of token DECODE_TOKENS - time of token 0).
HF is timed the same way, with a streamer that timestamps each token as generate
emits it (not as a difference of two generate calls). Trials are interleaved
(swarm, local, hf, swarm, ...) after one untimed warm-up of each; the median is
reported. tokens_match compares all DECODE_TOKENS + 1 greedy tokens.

--format (fp32 by default; bf16, int8, q4, q4/g32) serves and computes the model in
that weight format everywhere (the swarm runs `smollm2-135m@FORMAT`, model/catalog.py);
local and ring load the same quantized spans; hf (transformers) runs only for fp32 and
bf16 (it cannot load our quantized files). Faster spans make the fixed cost of the
network weigh more: compare swarm/local and swarm/ring across formats.

first_token_s is the wall time from Popen of `compushare run` (a fresh Python
process, a fresh client data dir) to the first byte on its stdout.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import platform
import selectors
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common  # noqa: E402, F401  (this checkout's src/)

import torch  # noqa: E402
import trio  # noqa: E402

from compushare.app.api.client import call  # noqa: E402
from compushare.config import resolve_cache_dir  # noqa: E402
from compushare.gc_policy import startup_done  # noqa: E402
from compushare.model.blocks import SpanRunner, load_full_model  # noqa: E402
from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.model.formats import parse_format  # noqa: E402
from compushare.model.head import ConsumerHead  # noqa: E402
from compushare.pipeline.client.chain import open_chain  # noqa: E402
from compushare.pipeline.client.consumer import RunRequest, prompt_ids_of  # noqa: E402
from compushare.pipeline.client.planner import SwarmPlanner  # noqa: E402
from compushare.pipeline.client.generate import generate  # noqa: E402
from compushare.pipeline.client.sampling import Sampler, SamplingParams  # noqa: E402
from compushare.net.dht import connect_bootstrap, open_dht  # noqa: E402
from compushare.net.host import open_host  # noqa: E402
from compushare.net.identity import load_or_create_identity  # noqa: E402
from compushare.app.swarm import node_command, split_blocks, start_node, stop_pids, wait_ready  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "What is the capital of France?"
NODES = 3
TARGET_RATIO = 0.90
TARGET_FIRST_TOKEN_S = 15.0
WARMUP_TOKENS = 8
CLI_MAX_TOKENS = 8
CLI_TIMEOUT_S = 120.0


def log(text: str = "") -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------- cleanup


class Cleanup:
    """Stops every node process we started (SIGTERM, then SIGKILL, by pid) and removes
    the temp dir. Runs from `finally`, atexit and on SIGTERM/SIGHUP; idempotent."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="compushare-bench-"))
        self._done = False
        atexit.register(self.run)

    def run(self) -> None:
        if self._done:
            return
        self._done = True
        live = [p for p in self.procs if p.poll() is None]
        with contextlib.suppress(Exception):
            stop_pids([p.pid for p in live])
        for proc in self.procs:  # stop_pids only signals processes that look like nodes
            if proc.poll() is None:
                with contextlib.suppress(Exception):
                    proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


# --------------------------------------------------------------------------- swarm


def start_swarm(cleanup: Cleanup, num_blocks: int, name: str = MODEL) -> tuple[list[str], list[dict]]:
    """NODES node processes, each with its own data dir under the temp dir (the model
    is hard-linked from the shared cache); the first is every other's bootstrap."""
    spans = split_blocks(num_blocks, NODES)
    dirs = [cleanup.tmp / f"node-{i}" for i in range(NODES)]
    first = start_node(node_command(name, spans[0], dirs[0], []), dirs[0])
    cleanup.procs.append(first)
    states = [wait_ready(first, dirs[0])]
    bootstrap = states[0]["addrs"][:1]
    rest = []
    for span, data_dir in zip(spans[1:], dirs[1:]):
        proc = start_node(node_command(name, span, data_dir, bootstrap), data_dir)
        cleanup.procs.append(proc)
        rest.append((proc, data_dir))
    states += [wait_ready(proc, data_dir) for proc, data_dir in rest]
    return bootstrap, states


class SwarmClient:
    """A libp2p client host (with a DHT client) living in its own thread's trio loop,
    so it keeps serving its connections while the main thread runs the local and HF
    trials. The main thread submits swarm trials with trio.from_thread."""

    def __init__(self, data_dir: Path, bootstrap: list[str], model, head: ConsumerHead,
                 prompt_ids: list[int]) -> None:
        self.data_dir, self.bootstrap, self.model = data_dir, bootstrap, model
        self.head, self.prompt_ids = head, prompt_ids
        self.route = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=self._thread_main, name="swarm-client", daemon=True)

    def start(self, timeout: float = 120.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"swarm client not ready after {timeout:.0f}s")
        if self._error is not None:
            raise self._error

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to the main thread by start()
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        key_pair = load_or_create_identity(self.data_dir)
        with trio.CancelScope() as scope:
            self._scope = scope
            async with open_host(key_pair, ["/ip4/127.0.0.1/tcp/0"]) as host, \
                    open_dht(host, server=False) as dht:
                self.host = host
                await connect_bootstrap(host, dht, self.bootstrap)
                self.route = await SwarmPlanner(host, dht, self.model.model_id, self.model.num_blocks).first_route()
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await trio.sleep_forever()

    async def _trial(self, decode_tokens: int) -> dict:
        produced: list[int] = []
        times: list[float] = []

        def on_token(token: int) -> None:
            times.append(time.perf_counter())
            produced.append(token)

        steps = decode_tokens + 1  # the prefill's step yields token 0, untimed
        max_tokens = len(self.prompt_ids) + steps
        async with open_chain(self.host, self.route, self.model.model_id, max_tokens=max_tokens,
                              hidden_size=self.model.hidden_size) as chain:
            # The production consumer loop: embeddings + head local, blocks remote,
            # head.logits + sampling in a worker thread, one chain.step per token.
            await generate(chain, self.head, self.prompt_ids,
                           SamplingParams(max_new_tokens=steps, stop_at_eos=False), on_token=on_token)
        return _result(produced, times)

    def trial(self, decode_tokens: int) -> dict:
        return trio.from_thread.run(self._trial, decode_tokens, trio_token=self._token)

    def close(self) -> None:
        if self._token is not None and self._scope is not None:
            with contextlib.suppress(Exception):
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(timeout=10)


# --------------------------------------------------------------------------- ring

# A ring step: position, tokens (0: start a new KV cache), then tokens x hidden fp32.
RING_HEADER = struct.Struct("<II")


def _read_exact(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("ring pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def ring_worker(span: str, model_dir: str, read_fd: int, write_fd: int) -> None:
    """One ring process: read a step, run the span on it, pass the output on."""
    torch.set_num_threads(1)
    start, end = (int(x) for x in span.split(":"))
    runner = SpanRunner.load(Path(model_dir), start, end)
    startup_done()  # as a node does once its span is loaded
    cache = runner.new_cache()
    while True:
        try:
            header = _read_exact(read_fd, RING_HEADER.size)
        except EOFError:
            return
        position, tokens = RING_HEADER.unpack(header)
        if tokens == 0:
            cache = runner.new_cache()
            _write_all(write_fd, header)
            continue
        data = bytearray(_read_exact(read_fd, tokens * runner.hidden_size * 4))
        hidden = torch.frombuffer(data, dtype=torch.float32).view(1, tokens, runner.hidden_size)
        output = runner.forward(hidden, cache, position)
        _write_all(write_fd, header + output.contiguous().numpy().tobytes())


class Ring:
    """Worker processes, one per span, chained by pipes: this process -> span 0 ->
    span 1 -> span 2 -> this process."""

    def __init__(self, cleanup: Cleanup, model_dir: Path, spans: list[tuple[int, int]], hidden_size: int) -> None:
        self.hidden_size = hidden_size
        pipes = [os.pipe() for _ in range(len(spans) + 1)]
        for k, (start, end) in enumerate(spans):
            read_fd, write_fd = pipes[k][0], pipes[k + 1][1]
            cleanup.procs.append(subprocess.Popen(
                [sys.executable, __file__, "--ring-worker", f"{start}:{end}", str(model_dir), str(read_fd),
                 str(write_fd)], pass_fds=(read_fd, write_fd), stdin=subprocess.DEVNULL))
        self.send_fd, self.receive_fd = pipes[0][1], pipes[-1][0]
        for k, (read_fd, write_fd) in enumerate(pipes):  # the workers hold the rest
            if k:
                os.close(write_fd)
            if k < len(spans):
                os.close(read_fd)

    def reset(self) -> None:
        _write_all(self.send_fd, RING_HEADER.pack(0, 0))
        _read_exact(self.receive_fd, RING_HEADER.size)

    def forward(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        tokens = hidden.shape[1]
        _write_all(self.send_fd, RING_HEADER.pack(position, tokens) + hidden.contiguous().numpy().tobytes())
        _read_exact(self.receive_fd, RING_HEADER.size)
        data = bytearray(_read_exact(self.receive_fd, tokens * self.hidden_size * 4))
        return torch.frombuffer(data, dtype=torch.float32).view(1, tokens, self.hidden_size)

    def close(self) -> None:
        for fd in (self.send_fd, self.receive_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


# --------------------------------------------------------------------------- local, hf


def _result(tokens: list[int], times: list[float]) -> dict:
    steps = [b - a for a, b in zip(times, times[1:])]
    decode_s = times[-1] - times[0]
    return {
        "tokens": tokens,
        "decode_s": decode_s,
        "tok_s": (len(times) - 1) / decode_s,
        "step_ms_median": 1000 * statistics.median(steps),
        "step_ms_max": 1000 * max(steps),
    }


def _first_mismatch(reference: list[int], results: list[dict]) -> int | None:
    """The earliest token index where any trial differs from `reference` (None: all equal)."""
    found = [next((i for i, (a, b) in enumerate(zip(reference, r["tokens"])) if a != b),
                  None if len(r["tokens"]) == len(reference) else min(len(reference), len(r["tokens"])))
             for r in results]
    found = [i for i in found if i is not None]
    return min(found) if found else None


def local_trial(runners: list[SpanRunner], head: ConsumerHead, prompt_ids: list[int], decode_tokens: int) -> dict:
    """The same spans and head in-process, mirroring pipeline/generate.py without the
    network (and without its worker-thread hop for the head)."""
    caches = [runner.new_cache() for runner in runners]  # one per "server", as in the swarm

    def through(hidden: torch.Tensor, position: int) -> torch.Tensor:
        for runner, cache in zip(runners, caches):
            hidden = runner.forward(hidden, cache, position)
        return hidden

    return _greedy(through, head, prompt_ids, decode_tokens)


def ring_trial(ring: Ring, head: ConsumerHead, prompt_ids: list[int], decode_tokens: int) -> dict:
    """The local trial's loop with the spans in the ring's processes."""
    ring.reset()
    return _greedy(ring.forward, head, prompt_ids, decode_tokens)


def _greedy(through, head: ConsumerHead, prompt_ids: list[int], decode_tokens: int) -> dict:
    sampler = Sampler(SamplingParams(max_new_tokens=decode_tokens + 1, stop_at_eos=False))
    hidden = through(head.embed_tokens(prompt_ids), 0)
    position = len(prompt_ids)
    token = sampler.choose(head.logits(hidden))
    tokens, times = [token], [time.perf_counter()]
    for _ in range(decode_tokens):
        hidden = through(head.embed_tokens([token]), position)
        position += 1
        token = sampler.choose(head.logits(hidden))
        tokens.append(token)
        times.append(time.perf_counter())
    return _result(tokens, times)


class _TokenClock:
    """A generate() streamer that timestamps each new token (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_trial(model, prompt_ids: list[int], decode_tokens: int) -> dict:
    """HF generate, greedy, decode_tokens + 1 new tokens, never stopping at EOS.
    Timed with a streamer: from the emission of new token 0 (end of prefill) to the
    emission of the last one, i.e. decode_tokens decode steps.

    eos_token_id=None matters: with the model's EOS id set, min_new_tokens makes HF
    mask EOS out of the logits, so HF would pick a different token wherever greedy
    decoding wants EOS (SmolLM2 does at token 7 of this prompt). Our loop with
    stop_at_eos=False emits EOS and carries on; so does HF without an EOS id (and
    min_new_tokens is then a no-op, kept as a guard)."""
    clock = _TokenClock()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=decode_tokens + 1,
                             min_new_tokens=decode_tokens + 1, eos_token_id=None, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=0, streamer=clock)
    tokens = out[0, len(prompt_ids):].tolist()
    assert len(clock.times) == len(tokens) == decode_tokens + 1, (len(clock.times), len(tokens))
    return _result(tokens, clock.times)


# --------------------------------------------------------------------------- first token


def cli_first_token(client_dir: Path, bootstrap: str, stderr_path: Path, name: str = MODEL) -> float:
    """Wall time from Popen of `compushare run` to the first byte on its stdout."""
    cmd = [sys.executable, "-m", "compushare", "run", "--model", name, "--home", str(client_dir),
           "--bootstrap", bootstrap, "--max-tokens", str(CLI_MAX_TOKENS), PROMPT]
    with open(stderr_path, "wb") as err:
        began = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        try:
            first = None
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)
                deadline = began + CLI_TIMEOUT_S
                while first is None and time.perf_counter() < deadline:
                    if sel.select(timeout=max(0.0, deadline - time.perf_counter())):
                        chunk = os.read(proc.stdout.fileno(), 1)
                        if not chunk:
                            break  # EOF before any output
                        first = time.perf_counter() - began
            rest, _ = proc.communicate(timeout=CLI_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"`compushare run` failed (exit {proc.returncode}, first byte {first}):\n"
                           + stderr_path.read_text(errors="replace")[-2000:])
    return first


# --------------------------------------------------------------------------- main


def machine_info() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import libp2p  # noqa: F401
    import transformers
    from importlib.metadata import version

    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "libp2p": version("libp2p"),
            "torch_threads": torch.get_num_threads(), "platform": platform.platform()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="timed decode tokens per trial")
    parser.add_argument("--format", default="fp32", help="weight format: fp32, bf16, int8, q4, q4/g32")
    parser.add_argument("--ring-worker", nargs=4, help=argparse.SUPPRESS)  # internal: span, model dir, fds
    args = parser.parse_args()
    if args.ring_worker:
        span, model_dir, read_fd, write_fd = args.ring_worker
        ring_worker(span, model_dir, int(read_fd), int(write_fd))
        return 0

    wall_began = time.perf_counter()
    fmt = parse_format(args.format)
    model_name = MODEL if fmt.name == "fp32" else f"{MODEL}@{args.format}"
    torch.set_num_threads(1)
    # Ctrl-C (also when started with SIGINT ignored, e.g. `cmd &` from a script),
    # SIGTERM and SIGHUP all unwind through the `finally` below.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    cleanup = Cleanup()
    client = ring = None
    try:
        log(f"pipeline overhead bench: {model_name}, {NODES} nodes, {args.tokens} decode tokens, "
            f"{args.trials} interleaved trials, {fmt.label}, 1 torch thread per process")
        log(f"cache {resolve_cache_dir()}, temp {cleanup.tmp}")

        began = time.perf_counter()
        bench_dir = cleanup.tmp / "bench"
        model = resolve_model(model_name, bench_dir)
        bootstrap, states = start_swarm(cleanup, model.num_blocks, model_name)
        log(f"swarm up in {time.perf_counter() - began:.1f}s: "
            + ", ".join(f"pid {s['pid']} [{s['start']}:{s['end']}]" for s in states))

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model.path))
        prompt_ids = prompt_ids_of(tokenizer, RunRequest(model=model_name, prompt=PROMPT))
        head = ConsumerHead.load(model.path)
        runners = [SpanRunner.load(model.path, start, end) for start, end in split_blocks(model.num_blocks, NODES)]
        # sdpa, like the spans; transformers cannot load our quantized files
        hf_model = None if fmt.quantized else load_full_model(model.path, dtype=torch.bfloat16 if fmt.name == "bf16"
                                                               else torch.float32)
        ring = Ring(cleanup, model.path, split_blocks(model.num_blocks, NODES), model.hidden_size)
        log(f"prompt: {len(prompt_ids)} tokens (chat template of {PROMPT!r})")

        client = SwarmClient(bench_dir, bootstrap, model, head, prompt_ids)
        client.start()
        route = [(h.start, h.end) for h in client.route]
        log(f"route: {route}")
        if route != split_blocks(model.num_blocks, NODES):
            raise RuntimeError(f"unexpected route {route}")

        runs = {
            "swarm": lambda n: client.trial(n),
            "local": lambda n: local_trial(runners, head, prompt_ids, n),
            "hf": lambda n: hf_trial(hf_model, prompt_ids, n),
            "ring": lambda n: ring_trial(ring, head, prompt_ids, n),
        }
        if hf_model is None:
            del runs["hf"]
        for run in runs.values():  # warm-up: first-call costs, connections, caches
            run(WARMUP_TOKENS)
        results: dict[str, list[dict]] = {name: [] for name in runs}
        for trial in range(args.trials):
            for name, run in runs.items():
                result = run(args.tokens)
                results[name].append(result)
                log(f"trial {trial + 1} {name:5} {result['tok_s']:7.2f} tok/s  "
                    f"step median {result['step_ms_median']:6.2f} ms  max {result['step_ms_max']:6.2f} ms")

        med = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in results.items()}
        step_med = {name: statistics.median(r["step_ms_median"] for r in rs) for name, rs in results.items()}
        local_tokens = results["local"][0]["tokens"]
        local_stable = all(r["tokens"] == local_tokens for r in results["local"])
        tokens_match = local_stable and all(r["tokens"] == local_tokens for r in results["swarm"])
        tokens_match_hf = all(r["tokens"] == local_tokens for r in results["hf"]) if "hf" in results else None
        mismatch = {name: _first_mismatch(local_tokens, rs) for name, rs in results.items() if name != "local"}
        ratio = med["swarm"] / med["local"]
        ring_ratio = med["ring"] / med["local"]
        tokens_match_ring = all(r["tokens"] == local_tokens for r in results["ring"])

        first_token: list[float] = []
        client_dir = cleanup.tmp / "cli-client"
        for attempt in range(2):  # 1st: fresh data dir (identity + model import); 2nd: same dir
            first_token.append(cli_first_token(client_dir, bootstrap[0], cleanup.tmp / f"cli-{attempt}.err",
                                               model_name))
            log(f"compushare run: first byte on stdout after {first_token[-1]:.2f}s "
                f"({'fresh' if attempt == 0 else 'reused'} client dir)")
        first_token_s = statistics.median(first_token)
        # Decode steps each node computed from its upstream's push (pipeline/server/push.py).
        pushed = [call(cleanup.tmp / f"node-{i}", state["api"], "/control/status").get("pushed_steps")
                  for i, state in enumerate(states)]
        log(f"steps started by a push, per node: {pushed}")

        log()
        log(f"swarm  {med['swarm']:7.2f} tok/s  ({step_med['swarm']:.2f} ms/token)")
        log(f"local  {med['local']:7.2f} tok/s  ({step_med['local']:.2f} ms/token)")
        if "hf" in med:
            log(f"hf     {med['hf']:7.2f} tok/s  ({step_med['hf']:.2f} ms/token)")
        log(f"ring   {med['ring']:7.2f} tok/s  ({step_med['ring']:.2f} ms/token): ring/local {ring_ratio:.3f} "
            f"(3 processes, no network stack); swarm/ring {med['swarm'] / med['ring']:.3f} (the network stack)")
        log(f"ratio swarm/local {ratio:.3f} (target >= {TARGET_RATIO:.2f}): "
            f"{'OK' if ratio >= TARGET_RATIO else 'BELOW TARGET'}; "
            f"swarm overhead {step_med['swarm'] - step_med['local']:.2f} ms/token")
        log(f"tokens_match {tokens_match} (target true); HF tokens equal too: {tokens_match_hf}"
            + "".join(f"; {n} differs first at token {i}" for n, i in mismatch.items() if i is not None))
        log(f"first_token_s {first_token_s:.2f} (target <= {TARGET_FIRST_TOKEN_S:.0f}): "
            f"{'OK' if first_token_s <= TARGET_FIRST_TOKEN_S else 'ABOVE TARGET'}")
        log(f"text: {tokenizer.decode(local_tokens, skip_special_tokens=True)!r}")
        wall_s = time.perf_counter() - wall_began
        log(f"wall time {wall_s:.1f}s")

        summary = {
            "swarm_tok_s": round(med["swarm"], 3),
            "local_tok_s": round(med["local"], 3),
            "hf_generate_tok_s": round(med["hf"], 3) if "hf" in med else None,
            "ratio": round(ratio, 4),
            "tokens_match": tokens_match,
            "tokens_match_hf": tokens_match_hf,
            "ring_tok_s": round(med["ring"], 3),
            "ring_ratio": round(ring_ratio, 4),
            "swarm_vs_ring": round(med["swarm"] / med["ring"], 4),
            "tokens_match_ring": tokens_match_ring,
            "first_mismatch": mismatch,
            "first_token_s": round(first_token_s, 3),
            "targets": {"ratio": TARGET_RATIO, "tokens_match": True, "first_token_s": TARGET_FIRST_TOKEN_S},
            "targets_met": {"ratio": ratio >= TARGET_RATIO, "tokens_match": tokens_match,
                            "first_token_s": first_token_s <= TARGET_FIRST_TOKEN_S},
            "step_ms_median": {k: round(v, 3) for k, v in step_med.items()},
            "swarm_overhead_ms_per_token": round(step_med["swarm"] - step_med["local"], 3),
            "trials": {name: [round(r["tok_s"], 3) for r in rs] for name, rs in results.items()},
            "trials_step_ms_median": {name: [round(r["step_ms_median"], 2) for r in rs] for name, rs in results.items()},
            "first_token_s_trials": [round(t, 3) for t in first_token],
            "decode_tokens": args.tokens,
            "prompt_tokens": len(prompt_ids),
            "model": model_name,
            "format": fmt.label,
            "model_id": model.model_id,
            "nodes": NODES,
            "route": route,
            "pushed_steps": pushed,
            "machine": machine_info(),
            "wall_s": round(wall_s, 1),
        }
        print(json.dumps(summary), flush=True)
        return 0
    finally:
        if client is not None:
            client.close()
        if ring is not None:
            ring.close()
        cleanup.run()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        print(f"interrupted ({str(exc) or 'SIGINT'}); node processes stopped", file=sys.stderr)
        sys.exit(130)
