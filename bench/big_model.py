"""A model no node holds: Llama-3.1-8B's or gpt-oss-20b's shapes across 3 nodes, beside llama.cpp on the same file.

    .venv/bin/python bench/big_model.py [--shape llama-3.1-8b | gpt-oss-20b] [--tokens 64] [--type Q4_K_M]
                                        [--threads 1,2] [--runtime auto] [--results bench/results/big_model.jsonl]

file      tools/synthetic_gguf.py: the shape's exact sizes with deterministic random
          weights, written once into the cache. llama-3.1-8b: 32 layers, hidden 4096,
          intermediate 14336, 32/8 heads, 128,256 tokens (8.0 B parameters), laid out
          as llama.cpp's quantizer lays out Q4_K_M (Q4_K; Q6_K for the output matrix
          and for v and down in the layers it gives more bits) or all Q4_0 (--type).
          gpt-oss-20b: 24 layers of 32 experts, 4 a token (20.9 B parameters, 4.2 B
          active with both embedding matrices), hidden 2880, 64/8 heads of 64, sliding windows of 128 on every
          other layer, attention sinks, YaRN, 201,088 tokens; MXFP4 experts and Q8_0
          matrices, as the file people download.
runtime   what the nodes and the one-process reference compute with (--runtime: auto
          is ggml for a GGUF on CPU; torch the previous runs' runtime); the consumer's
          head likewise. Each of --threads runs the swarm, the reference and llama.cpp
          at that many threads per process, side by side.
import    `compushare models import FILE --name big8b` into node 0's data dir: the
          GGUF's own Q4_0 blocks kept (no second quantization), streamed tensor by
          tensor; wall time and the process's peak RSS (wait4's ru_maxrss).
swarm     `compushare swarm up --nodes 3 --memory-budget-mb B`: node 0 holds the
          imported model, nodes 1 and 2 start with empty data dirs and fetch their
          spans' block files from node 0 through the piece protocol. B is set so that
          no node may hold more than 40 % of the blocks (12 of 32) whatever its
          interpreter holds above 300 MB; each node reports what it held before its
          span loaded and how many blocks its budget fits (node.json "memory",
          "max_blocks"). Each node computes with --threads threads.
consumer  a process of its own, a fresh data dir (it fetches the head: embeddings and LM
          head, from the swarm): the prompt's token ids, `--tokens` greedy tokens,
          no speculation (llama.cpp drafts nothing either), no spot checks; its peak
          RSS (wait4) is reported.
          first_token_s counts from the start of `swarm up` (node start-up, span
          fetches, loads, the head's fetch, the prompt) to the first token.
reference one process serving the same store (every block in one span on the
          runtime, the head beside it): its greedy tokens must equal the swarm's
          (`identical`), and its decode speed is the swarm's compute without the network.
llamacpp  bench/llamacpp_ref.py's build on the very same file, the same threads, the
          same prompt ids, flash attention on (llama.cpp's CPU default), decode tok/s
          (median of 3 trials); `identical_to_llamacpp`: the swarm's tokens are its.
memory    each node's peak RSS (VmHWM) against its budget and against its span's file
          bytes (`max_rss_over_span_mb`), after the run;
          bandwidth: one token reads every block's weights once (of a mixture of
          experts, the dense tensors and the experts it chose: `bytes_per_token_gb`,
          counted by the one-process reference's ggml span from each step's routes,
          against `active_gb`, the active parameters' bytes), and the LM head; a copy
          of that many bytes (measured here, 1 thread) bounds the decode rate.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, finish  # noqa: E402  (this checkout's src/)

sys.path.insert(0, str(REPO / "tools"))
import synthetic_gguf  # noqa: E402
import llamacpp_ref  # noqa: E402
from compushare.config import resolve_cache_dir  # noqa: E402

NAMES = {"llama-3.1-8b": "big8b", "gpt-oss-20b": "big-gpt-oss-20b"}  # what `models import` names it
NAME = NAMES["llama-3.1-8b"]
NODES = 3
MAX_SHARE = 0.4  # no node may hold more than this share of the blocks
HELD_FLOOR_MB = 300  # no node process holds less than this before its span (torch, libp2p; ~320 MB on ggml)
PROMPT = llamacpp_ref.DEFAULT_PROMPT
MB = 1024 * 1024


def log(message: str) -> None:
    print(message, flush=True)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "compushare", *args]


def measured(cmd: list[str], *, env: dict, out: Path, timeout: float) -> tuple[float, float]:
    """Run `cmd` (stdout + stderr to `out`): (wall seconds, peak RSS in MB), or raise."""
    began = time.monotonic()
    with open(out, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = began + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{cmd[3:5]} timed out after {timeout:.0f} s")
            time.sleep(0.05)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    seconds = time.monotonic() - began
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:5])} failed ({proc.returncode}):\n{out.read_text()[-3000:]}")
    return seconds, usage.ru_maxrss / 1024


def settled_state(data_dir: Path, timeout: float = 60.0) -> dict:
    """node.json once it says what the node holds against its budget (its first
    version is written as the span starts serving, before that is known)."""
    deadline = time.monotonic() + timeout
    while True:
        state = json.loads((data_dir / "node.json").read_text())
        if state.get("memory") or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def parameters(config: dict, *, active: bool = False) -> int:
    """A model's parameter count from its config (stored tensors may be packed): a Llama's,
    or a gpt-oss's (biases, sinks and router included); `active`: with only the experts a
    token uses."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:  # gpt-oss: q/k/v/o biases, sinks, a biased router, biased experts
        used = config["num_experts_per_tok"] if active else experts
        block = (attention + heads * head_dim + 2 * kv * head_dim + hidden + heads + experts * (hidden + 1)
                 + used * (3 * hidden * inter + 2 * inter + hidden) + 2 * hidden)
    else:
        block = attention + 3 * hidden * inter + 2 * hidden
    heads_out = 1 if config.get("tie_word_embeddings") else 2
    return layers * block + heads_out * config["vocab_size"] * hidden + hidden


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmHWM for {pid}")


def copy_gb_s(nbytes: int = 1 << 30) -> float:
    """One thread copying a buffer larger than any cache: GB/s moved (read + write)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        best = float("inf")
        for _ in range(3):
            began = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - began)
        return 2 * nbytes / best / 1e9
    finally:
        torch.set_num_threads(previous)


REFERENCE = r"""
import json, sys, time, torch
from compushare.spans import load_head, load_span
model_dir, prompt, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
runtime, threads = sys.argv[5], int(sys.argv[6])
torch.set_num_threads(threads)
began = time.perf_counter()
head = load_head(model_dir, runtime=runtime)
runner = load_span(model_dir, 0, int(sys.argv[4]), runtime=runtime, threads=threads)
loaded = time.perf_counter() - began
cache = runner.new_cache()
hidden = runner.forward(head.embed_tokens(prompt), cache, 0)
tokens, times = [int(torch.argmax(head.logits(hidden)))], [time.perf_counter()]
reads = getattr(runner, "reads", None)  # ggml: the weight bytes each forward read
before = reads.bytes if reads else 0
while len(tokens) < count:
    hidden = runner.forward(head.embed_tokens(tokens[-1:]), cache, len(prompt) + len(tokens) - 1)
    tokens.append(int(torch.argmax(head.logits(hidden))))
    times.append(time.perf_counter())
experts = getattr(runner, "recipe", None) and runner.recipe.experts
print(json.dumps({"tokens": tokens, "load_s": loaded, "runtime": getattr(runner, "runtime", "torch"),
                  "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
                  "span_bytes_per_token": (reads.bytes - before) / (len(tokens) - 1) if reads and count > 1 else None,
                  "span_active_bytes": reads.active_bytes(experts.used if experts else 0) if reads else None}))
"""


def reference(model_dir: Path, prompt: list[int], count: int, blocks: int, env: dict, out: Path, *,
              runtime: str, threads: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", REFERENCE, str(model_dir), json.dumps(prompt), str(count),
                           str(blocks), runtime, str(threads)], capture_output=True, text=True, env=env, timeout=1800)
    out.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the one-process reference failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


CONSUMER = r"""
import json, sys, trio
from pathlib import Path
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
home, bootstrap, prompt, count, name = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
request = RunRequest(model=name, prompt=prompt, chat_template=False, speculate=False,
                     params=SamplingParams(temperature=0.0, max_new_tokens=count, stop_at_eos=False))
outcome = trio.run(lambda: run_prompt(Path(home), tuple(bootstrap), request, spot_check_rate=0.0))
print(json.dumps({"tokens": outcome.tokens, "first_token_s": outcome.first_token_s,
                  "decode_tok_s": outcome.decode_tok_s, "direct_steps": outcome.direct_steps,
                  "spans": [[h.start, h.end] for h in outcome.route]}))
"""


def consume(home: Path, bootstrap: list[str], prompt: list[int], count: int, env: dict, out: Path) -> dict:
    """The consumer in a process of its own: its outcome and its peak RSS (MB)."""
    _, rss = measured([sys.executable, "-c", CONSUMER, str(home), json.dumps(bootstrap), json.dumps(prompt),
                       str(count), NAME], env=env, out=out, timeout=1800)
    return json.loads(out.read_text().strip().splitlines()[-1]) | {"peak_rss_mb": rss}


def span_file_bytes(data_dir: Path, model_id: str, span: tuple[int, int]) -> int:
    """The bytes of the block files a node's span is made of (what it must hold)."""
    return sum((data_dir / "models" / model_id / f"block-{i:04d}.safetensors").stat().st_size
               for i in range(*span))


def run_swarm(swarm_home: Path, budget_mb: int, kv_tokens: int, threads: int, runtime: str, env: dict, root: Path,
              prompt: list[int], count: int, model_id: str) -> dict:
    """`swarm up` at `threads` threads a node, a consumer's generation, the nodes' peaks; then `swarm down`."""
    began = time.monotonic()
    measured(cli("swarm", "up", "--nodes", str(NODES), "--model", NAME, "--home", str(swarm_home),
                 "--memory-budget-mb", str(budget_mb), "--kv-budget", str(kv_tokens), "--threads", str(threads),
                 "--runtime", runtime), env=env, out=root / f"swarm_up_t{threads}.log", timeout=1800)
    up_s = time.monotonic() - began
    try:
        swarm = json.loads((swarm_home / "swarm.json").read_text())
        states = [settled_state(Path(n["data_dir"])) for n in swarm["nodes"]]
        log(f"swarm up ({threads} thread{'s' * (threads > 1)}) in {up_s:.1f} s: " + ", ".join(
            f"{s['start']}:{s['end']} (fits {s['max_blocks']}, held {s['memory']['held_mb']} MB)" for s in states))
        fetched = [f for s in states for f in s.get("fetched", [])]
        outcome = consume(root / "consumer", swarm["bootstrap"], prompt, count, env, root / f"consumer_t{threads}.log")
        peaks = [peak_rss_mb(n["pid"]) for n in swarm["nodes"]]
    finally:
        subprocess.run(cli("swarm", "down", "--home", str(swarm_home)), env=env, timeout=60, capture_output=True)
    span_mb = [span_file_bytes(Path(n["data_dir"]), model_id, (st["start"], st["end"])) / MB
               for n, st in zip(swarm["nodes"], states)]
    log(f"swarm: first token {up_s + outcome['first_token_s']:.1f} s after `swarm up` began, "
        f"{outcome['decode_tok_s']:.2f} tok/s; consumer peak RSS {outcome['peak_rss_mb']:.0f} MB")
    for st, peak, held in zip(states, peaks, span_mb):
        log(f"  node {st['start']}:{st['end']}: peak RSS {peak:.0f} MB, span file {held:.0f} MB "
            f"(+{peak - held:.0f} MB), budget {budget_mb} MB")
    return {"up_s": up_s, "outcome": outcome, "peaks": peaks, "span_mb": span_mb, "states": states,
            "fetched": fetched}


def main() -> None:
    global NAME
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(NAMES))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--type", default=None, choices=synthetic_gguf.TYPES,
                        help="default: Q4_K_M for Llama, MXFP4 (its experts) for gpt-oss")
    parser.add_argument("--threads", default="1,2", help="Threads per process, comma-separated: a run each.")
    parser.add_argument("--runtime", default="auto", choices=("auto", "ggml", "torch"))
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "big_model.jsonl"))
    parser.add_argument("--keep", action="store_true", help="Keep the scratch dir (data dirs, logs).")
    args = parser.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]

    NAME = NAMES[args.shape]
    kind = args.type or ("MXFP4" if args.shape.startswith("gpt-oss") else "Q4_K_M")
    gguf_path = synthetic_gguf.ensure(args.shape, kind, log=log)
    log(f"file: {gguf_path} ({gguf_path.stat().st_size / 1e9:.2f} GB)")
    root = Path(tempfile.mkdtemp(prefix="big-model-", dir=resolve_cache_dir().parent))
    # A cache of their own: the import must convert, not hard-link an earlier run's conversion.
    env = dict(os.environ, COMPUSHARE_HOME=str(root / "home"), COMPUSHARE_CACHE=str(root / "cache"),
               PYTHONUNBUFFERED="1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the nodes (finally below)
    swarm_home = root / "swarm"
    failed = True
    try:
        # -- import, as a user would, into what will be node 0's data dir
        node0 = swarm_home / "node-0"
        import_s, import_rss = measured(cli("models", "import", str(gguf_path), "--name", NAME, "--json",
                                            "--data-dir", str(node0)), env=env, out=root / "import.log", timeout=1800)
        imported = json.loads((root / "import.log").read_text().strip().splitlines()[-1])
        log(f"import: {import_s:.1f} s, peak RSS {import_rss:.0f} MB, format {imported['format']}, "
            f"{imported['bytes'] / 1e9:.2f} GB stored")

        from compushare.model.store import ModelStore
        from compushare.pipeline.server.provider import block_cost, held_block_bytes
        from compushare.spans import runtime_for

        stored = ModelStore(node0).get(NAME)
        runtime = runtime_for(stored.path, args.runtime)
        config = stored.manifest.config
        params_b = parameters(config) / 1e9
        active_b = parameters(config, active=True) / 1e9
        experts = config.get("num_local_experts") or config.get("num_experts")
        if experts:
            log(f"model: {params_b:.1f} B parameters, {active_b:.1f} B active ({experts} experts, "
                f"{config['num_experts_per_tok']} a token)")
        kv_tokens = 8192
        cost = block_cost(stored, kv_tokens, runtime)
        most = int(MAX_SHARE * stored.num_blocks)
        budget_mb = HELD_FLOOR_MB + ((most + 1) * cost - 1) // MB  # fits `most` blocks, never most + 1
        log(f"model: {stored.num_blocks} blocks of {held_block_bytes(stored, runtime) / 1e6:.0f} MB on {runtime}; budget "
            f"{budget_mb} MB per node (at most {most} blocks, {cost / 1e6:.0f} MB each with a {kv_tokens}-token "
            f"KV budget)")
        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(str(stored.path))(PROMPT).input_ids
        runs = []
        for threads in thread_counts:
            swarm = run_swarm(swarm_home, budget_mb, kv_tokens, threads, runtime, env, root, prompt, args.tokens,
                              stored.model_id)
            outcome = swarm["outcome"]
            ref = reference(stored.path, prompt, len(outcome["tokens"]), stored.num_blocks, env,
                            root / f"reference_t{threads}.log", runtime=runtime, threads=threads)
            llama = llamacpp_ref.measure_llamacpp(gguf_path, prompt_tokens=prompt, decode_tokens=args.tokens,
                                                  trials=3, threads=threads)
            same_as_llama = llama["tokens"][:len(outcome["tokens"])] == outcome["tokens"]
            log(f"one process ({threads} thread{'s' * (threads > 1)}): {ref['decode_tok_s']:.2f} tok/s; llama.cpp "
                f"{llama['decode_tok_s']:.2f} tok/s; tokens: swarm = one process {ref['tokens'] == outcome['tokens']},"
                f" swarm = llama.cpp {same_as_llama}")
            runs.append({
                "threads": threads, "swarm_tok_s": round(outcome["decode_tok_s"], 3),
                "one_process_tok_s": round(ref["decode_tok_s"], 3), "llamacpp_tok_s": round(llama["decode_tok_s"], 3),
                "swarm_vs_llamacpp": round(outcome["decode_tok_s"] / llama["decode_tok_s"], 3),
                "one_process_vs_llamacpp": round(ref["decode_tok_s"] / llama["decode_tok_s"], 3),
                "identical": ref["tokens"] == outcome["tokens"], "identical_to_llamacpp": same_as_llama,
                "first_token_s": round(swarm["up_s"] + outcome["first_token_s"], 1),
                "swarm_up_s": round(swarm["up_s"], 1), "peak_rss_mb": [round(p) for p in swarm["peaks"]],
                "span_file_mb": [round(m) for m in swarm["span_mb"]],
                "max_rss_over_span_mb": round(max(p - m for p, m in zip(swarm["peaks"], swarm["span_mb"]))),
                "max_rss_over_budget_mb": round(max(p - budget_mb for p in swarm["peaks"])),
                "consumer_peak_rss_mb": round(outcome["peak_rss_mb"]),
                "spans": [f"{st['start']}:{st['end']}" for st in swarm["states"]],
                "fetched_gb": round(sum(f["bytes"] for f in swarm["fetched"]) / 1e9, 2),
                "direct_steps": outcome["direct_steps"], "span_bytes_per_token": ref.get("span_bytes_per_token"),
                "span_active_bytes": ref.get("span_active_bytes")})

        files = stored.manifest.files
        head = {name: t for f in files if f.role == "head" for name, t in f.tensors.items()}
        lm_head = head.get("lm_head.weight") or head["model.embed_tokens.weight"]  # tied: the embedding
        blocks_bytes = sum(f.size for f in files if f.role == "block")
        measured_reads = runs[0]["span_bytes_per_token"]  # ggml counts what each step read (MoE: chosen experts)
        token_bytes = (measured_reads or blocks_bytes) + lm_head.end - lm_head.begin
        active_bytes = (runs[0]["span_active_bytes"] or blocks_bytes) + lm_head.end - lm_head.begin
        copy = copy_gb_s()
        bound = copy * 1e9 / token_bytes
        log(f"bound: {token_bytes / 1e9:.2f} GB read per token (active parameters: {active_bytes / 1e9:.2f} GB; "
            f"every block: {blocks_bytes / 1e9:.2f} GB), copy at {copy:.1f} GB/s -> {bound:.2f} tok/s (1 thread)")
        result = {
            "shape": args.shape, "experts": {"count": experts, "used": config["num_experts_per_tok"]} if experts else None,
            "active_params_b": round(active_b, 2), "bytes_per_token_gb": round(token_bytes / 1e9, 3),
            "active_gb": round(active_bytes / 1e9, 3),
            "runtime": runtime, "type": kind, "threads": thread_counts, "params_b": round(params_b, 2),
            "import_s": round(import_s, 1), "import_peak_rss_mb": round(import_rss),
            "swarm_vs_llamacpp": min(r["swarm_vs_llamacpp"] for r in runs),
            "one_process_vs_llamacpp": min(r["one_process_vs_llamacpp"] for r in runs),
            "identical_to_llamacpp": all(r["identical_to_llamacpp"] for r in runs),
            "identical": all(r["identical"] for r in runs),
            "max_rss_over_span_mb": max(r["max_rss_over_span_mb"] for r in runs),
            "first_token_s": runs[0]["first_token_s"], "runs": runs, "budget_mb": budget_mb,
            "token_gb": round(token_bytes / 1e9, 2), "copy_gb_s": round(copy, 1),
            "bandwidth_bound_tok_s": round(bound, 2), "format": imported["format"],
            "cpu": llamacpp_ref.cpu_fingerprint(),
        }
        failed = False
    finally:
        from compushare.app.swarm import stop_pids

        # By the pid files, not swarm.json: `swarm up` writes that only once every node is up.
        stop_pids([int(p.read_text()) for p in swarm_home.glob("node-*/node.pid") if p.read_text().strip().isdigit()])
        if args.keep:
            log(f"scratch dir kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if failed:
        raise SystemExit(1)
    raise SystemExit(finish(result, args.results or None))


if __name__ == "__main__":
    main()
