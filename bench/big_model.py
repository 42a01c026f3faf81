"""A model no node holds: Llama-3.1-8B's shapes across 3 nodes, beside llama.cpp on the same file.

    .venv/bin/python bench/big_model.py [--tokens 64] [--results bench/results/big_model.jsonl]

file      tools/synthetic_gguf.py: Llama-3.1-8B's exact shapes (32 layers, hidden 4096,
          intermediate 14336, 32/8 heads, 128,256 tokens; 8.0 B parameters) as Q4_0
          with deterministic random weights, written once into the cache (~20 s).
import    `compushare models import FILE --name big8b` into node 0's data dir: the
          GGUF's own Q4_0 blocks kept (no second quantization), streamed tensor by
          tensor; wall time and the process's peak RSS (wait4's ru_maxrss).
swarm     `compushare swarm up --nodes 3 --memory-budget-mb B`: node 0 holds the
          imported model, nodes 1 and 2 start with empty data dirs and fetch their
          spans' block files from node 0 through the piece protocol. B is set so that
          no node may hold more than 40 % of the blocks (12 of 32) whatever its
          interpreter holds above 300 MB; each node reports what it held before its
          span loaded and how many blocks its budget fits (node.json "memory",
          "max_blocks"). Each node computes with 1 torch thread (the default).
consumer  this process, a fresh data dir (it fetches the head: embeddings and LM
          head, from the swarm): the prompt's token ids, `--tokens` greedy tokens,
          no speculation (llama.cpp drafts nothing either), no spot checks.
          first_token_s counts from the start of `swarm up` (node start-up, span
          fetches, loads, the head's fetch, the prompt) to the first token.
reference one process serving the same store (every block in one SpanRunner, the
          head beside it, 1 thread): its greedy tokens must equal the swarm's
          (`identical`), and its decode speed is the swarm's compute without the network.
llamacpp  bench/llamacpp_ref.py's build on the very same file, 1 thread, the same
          prompt ids, decode tok/s (median of 3 trials).
memory    each node's peak RSS (VmHWM) against its budget, after the run;
          bandwidth: one token reads every block's weights once, so a copy of that
          many bytes (measured here, 1 thread) bounds the decode rate.

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

NAME = "big8b"
NODES = 3
MAX_SHARE = 0.4  # no node may hold more than this share of the blocks
HELD_FLOOR_MB = 300  # no node process holds less than this before its span (torch + transformers + libp2p)
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


def parameters(config: dict) -> int:
    """A Llama-shaped model's parameter count, from its config (stored tensors may be packed)."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    block = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
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
torch.set_num_threads(1)
from compushare.model.blocks import SpanRunner
from compushare.model.head import ConsumerHead
model_dir, prompt, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
began = time.perf_counter()
head = ConsumerHead.load(model_dir)
runner = SpanRunner.load(model_dir, 0, runner_blocks := int(sys.argv[4]))
loaded = time.perf_counter() - began
cache = runner.new_cache()
hidden = runner.forward(head.embed_tokens(prompt), cache, 0)
tokens, times = [int(torch.argmax(head.logits(hidden)))], [time.perf_counter()]
while len(tokens) < count:
    hidden = runner.forward(head.embed_tokens(tokens[-1:]), cache, len(prompt) + len(tokens) - 1)
    tokens.append(int(torch.argmax(head.logits(hidden))))
    times.append(time.perf_counter())
print(json.dumps({"tokens": tokens, "load_s": loaded,
                  "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}))
"""


def reference(model_dir: Path, prompt: list[int], count: int, blocks: int, env: dict, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", REFERENCE, str(model_dir), json.dumps(prompt), str(count),
                           str(blocks)], capture_output=True, text=True, env=env, timeout=1800)
    out.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the one-process reference failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def consume(home: Path, bootstrap: list[str], prompt: list[int], count: int):
    import trio

    from compushare.pipeline.client.consumer import RunRequest, run_prompt
    from compushare.pipeline.client.sampling import SamplingParams

    request = RunRequest(model=NAME, prompt=prompt, chat_template=False, speculate=False,
                         params=SamplingParams(temperature=0.0, max_new_tokens=count, stop_at_eos=False))
    return trio.run(lambda: run_prompt(home, tuple(bootstrap), request, spot_check_rate=0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "big_model.jsonl"))
    parser.add_argument("--keep", action="store_true", help="Keep the scratch dir (data dirs, logs).")
    args = parser.parse_args()

    gguf_path = synthetic_gguf.ensure(log=log)
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
        from compushare.pipeline.server.provider import block_cost

        stored = ModelStore(node0).get(NAME)
        params_b = parameters(stored.manifest.config) / 1e9
        kv_tokens = 8192
        cost = block_cost(stored, kv_tokens)
        most = int(MAX_SHARE * stored.num_blocks)
        budget_mb = HELD_FLOOR_MB + ((most + 1) * cost - 1) // MB  # fits `most` blocks, never most + 1
        log(f"model: {stored.num_blocks} blocks of {stored.block_bytes / 1e6:.0f} MB; budget {budget_mb} MB "
            f"per node (at most {most} blocks, {cost / 1e6:.0f} MB each with a {kv_tokens}-token KV budget)")

        # -- the swarm, from `swarm up` to the first token
        began = time.monotonic()
        measured(cli("swarm", "up", "--nodes", str(NODES), "--model", NAME, "--home", str(swarm_home),
                     "--memory-budget-mb", str(budget_mb), "--kv-budget", str(kv_tokens)),
                 env=env, out=root / "swarm_up.log", timeout=1800)
        up_s = time.monotonic() - began
        swarm = json.loads((swarm_home / "swarm.json").read_text())
        states = [settled_state(Path(n["data_dir"])) for n in swarm["nodes"]]
        log(f"swarm up in {up_s:.1f} s: " + ", ".join(f"{s['start']}:{s['end']} (fits {s['max_blocks']}, held "
                                                       f"{s['memory']['held_mb']} MB)" for s in states))
        fetched = [f for s in states for f in s.get("fetched", [])]
        fetch_bytes, fetch_s = sum(f["bytes"] for f in fetched), max((f["seconds"] for f in fetched), default=0)
        log(f"fetched {fetch_bytes / 1e9:.2f} GB in {len(fetched)} spans from node 0, {fetch_s:.1f} s")

        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(str(stored.path))(PROMPT).input_ids
        outcome = consume(root / "consumer", swarm["bootstrap"], prompt, args.tokens)
        first_token_s = up_s + outcome.first_token_s
        log(f"swarm: first token {first_token_s:.1f} s after `swarm up` began ({outcome.first_token_s:.1f} s after "
            f"the consumer started), {outcome.decode_tok_s:.2f} tok/s, {outcome.direct_steps} steps direct")
        peaks = [peak_rss_mb(n["pid"]) for n in swarm["nodes"]]
        for s, peak in zip(states, peaks):
            log(f"  node {s['start']}:{s['end']}: peak RSS {peak:.0f} MB of a {budget_mb} MB budget")
        subprocess.run(cli("swarm", "down", "--home", str(swarm_home)), env=env, timeout=60, capture_output=True)
        # (the reference below needs the memory the nodes held)

        ref = reference(stored.path, prompt, len(outcome.tokens), stored.num_blocks, env, root / "reference.log")
        identical = ref["tokens"] == outcome.tokens
        log(f"one process: {ref['decode_tok_s']:.2f} tok/s, tokens identical: {identical}")
        llama = llamacpp_ref.measure_llamacpp(gguf_path, prompt_tokens=prompt, decode_tokens=args.tokens, trials=3)
        log(f"llama.cpp (1 thread): {llama['decode_tok_s']:.2f} tok/s")

        files = stored.manifest.files
        head = {name: t for f in files if f.role == "head" for name, t in f.tensors.items()}
        lm_head = head.get("lm_head.weight") or head["model.embed_tokens.weight"]  # tied: the embedding
        token_bytes = sum(f.size for f in files if f.role == "block") + lm_head.end - lm_head.begin
        copy = copy_gb_s()
        bound = copy * 1e9 / token_bytes
        log(f"bound: {token_bytes / 1e9:.2f} GB read per token, copy at {copy:.1f} GB/s -> {bound:.2f} tok/s")
        result = {
            "params_b": round(params_b, 2), "import_s": round(import_s, 1), "import_peak_rss_mb": round(import_rss),
            "fetch_mb_s": round(fetch_bytes / 1e6 / fetch_s, 1) if fetch_s else None,
            "fetched_gb": round(fetch_bytes / 1e9, 2),
            "swarm_tok_s": round(outcome.decode_tok_s, 3), "one_process_tok_s": round(ref["decode_tok_s"], 3),
            "llamacpp_tok_s": round(llama["decode_tok_s"], 3),
            "swarm_vs_llamacpp": round(outcome.decode_tok_s / llama["decode_tok_s"], 3),
            "one_process_vs_llamacpp": round(ref["decode_tok_s"] / llama["decode_tok_s"], 3),
            "identical": identical, "tokens": len(outcome.tokens),
            "budget_mb": budget_mb, "peak_rss_mb": [round(p) for p in peaks],
            "max_rss_over_budget_mb": round(max(p - budget_mb for p in peaks)),
            "spans": [f"{s['start']}:{s['end']}" for s in states], "fits_blocks": [s["max_blocks"] for s in states],
            "held_mb": [s["memory"]["held_mb"] for s in states],
            "swarm_up_s": round(up_s, 1), "first_token_s": round(first_token_s, 1),
            "token_gb": round(token_bytes / 1e9, 2), "copy_gb_s": round(copy, 1),
            "bandwidth_bound_tok_s": round(bound, 2), "format": imported["format"],
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
