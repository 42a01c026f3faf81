"""LoRA training steps through an 8B-shaped Q4_K_M model no node holds, beside one process.

    .venv/bin/python bench/finetune_big.py [--steps 2] [--sequences 2] [--seq-len 64] [--rank 8]
                                           [--train-memory-mb 2048] [--threads 2]

file      tools/synthetic_gguf.py's Llama-3.1-8B shapes in Q4_K_M (bench/big_model.py
          says how), imported as its GGUF's own blocks (`models import`).
swarm     `compushare swarm up --nodes 3`: blocks 0:11, 11:21, 21:32 (no node more
          than 40 % of them), served on ggml; each node's memory budget is what its
          span and KV budget cost (provider.block_cost) plus --train-memory-mb for
          training ([limits] train_memory_mb in its config.toml) plus 300 MB for the
          interpreter; nodes 1 and 2 fetch their blocks from node 0.
train     this process is the consumer: SwarmTrainer, LoRA rank --rank on q_proj and
          v_proj (PEFT's default targets) of every block, --steps steps of one microbatch of --sequences
          sequences of --seq-len tokens (bench/data/pd_english.txt, tokenized),
          AdamW lr 1e-3. Every span trains on torch twins of its layers built from
          the same file (model/span_training.py).
local     the same steps in one process on the same machine (LocalTrainer: every
          block on torch's GGUF kernels in one SpanRunner, one autograd graph), after
          the swarm's steps, from the same initial adapter.
generate  the swarm's trained adapter in use: 8 greedy tokens through the swarm
          (every ggml span applying it) against one process's ggml span of every
          block with the same adapter.
memory    each node's peak RSS (VmHWM) after the steps against its budget.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, finish  # noqa: E402  (this checkout's src/)

sys.path.insert(0, str(REPO / "bench"))
import big_model  # noqa: E402
import synthetic_gguf  # noqa: E402  (big_model put tools/ on the path)

NAME = "big8b"
DATA = REPO / "bench" / "data" / "pd_english.txt"
GENERATED = 8
MB = 1024 * 1024
# PEFT's default for Llama models. Every projection at rank 8 would be 29 MB of factors
# for an 11-layer span: past a frame's 16 MiB, so the consumer refuses it (train_hop).
TARGETS = ("q_proj", "v_proj")


def log(message: str) -> None:
    print(message, flush=True)


def training_batch(stored, sequences: int, seq_len: int):
    import torch
    from transformers import AutoTokenizer

    from compushare.model.train_head import IGNORE

    ids = AutoTokenizer.from_pretrained(str(stored.path))(DATA.read_text()[:200_000]).input_ids
    rows = torch.tensor([ids[i * seq_len:(i + 1) * seq_len] for i in range(sequences)])
    labels = torch.full_like(rows, IGNORE)
    labels[:, :-1] = rows[:, 1:]
    return [(rows, labels)]


async def swarm_steps(args, consumer_dir: Path, bootstrap: list[str], stored, initial, batch, adapter_path: Path):
    """The steps through the swarm, then a generation with the trained adapter: (step
    rows, the adapter, the generated tokens, the prompt ids)."""
    import dataclasses

    from compushare.model import adapter_file
    from compushare.model.training_state import OptimizerSettings, TrainingState
    from compushare.pipeline.client.consumer import Consumer, RunRequest
    from compushare.pipeline.client.planner import SwarmPlanner
    from compushare.pipeline.client.sampling import SamplingParams
    from compushare.pipeline.client.swarm_trainer import SwarmTrainer

    async with Consumer.connect(consumer_dir, tuple(bootstrap), NAME) as consumer:
        planner = SwarmPlanner(consumer.host, consumer.dht, stored.model_id, stored.num_blocks,
                               penalties=consumer.penalties, view=consumer.view, karma=consumer.karma,
                               fmt=stored.format.label)
        trainer = SwarmTrainer(consumer.host, planner, stored.model_id, consumer.head,
                               TrainingState(initial, OptimizerSettings(lr=1e-3)), spot_check_rate=0.0)
        await trainer.open()
        log("route: " + ", ".join(f"{s.start}:{s.end}" for s in trainer.stages))
        rows = []
        for step in range(args.steps):
            began = time.perf_counter()
            stats = await trainer.step(batch)
            rows.append({"step": step + 1, "loss": stats.loss, "seconds": time.perf_counter() - began})
            log(f"swarm step {step + 1}: loss {stats.loss:.6f} in {rows[-1]['seconds']:.1f} s")
        adapter = trainer.state.adapter()
        await trainer.close()
        adapter_file.save(adapter, adapter_path, base_model=NAME)
        prompt = batch[0][0][0, :16].tolist()
        request = RunRequest(model=NAME, prompt=prompt, chat_template=False, adapter=adapter_path, speculate=False,
                             params=SamplingParams(max_new_tokens=GENERATED, stop_at_eos=False))
        outcome = await consumer.generate(request)
        plain = await consumer.generate(dataclasses.replace(request, adapter=None))
        return rows, adapter, outcome.tokens, plain.tokens, prompt


def local_steps(args, stored, initial, batch) -> list[dict]:
    import torch

    from compushare.model.blocks import SpanRunner
    from compushare.model.head import ConsumerHead
    from compushare.model.local_training import LocalTrainer
    from compushare.model.training_state import OptimizerSettings, TrainingState

    torch.set_num_threads(args.threads)
    local = LocalTrainer(SpanRunner.load(stored.path, 0, stored.num_blocks), ConsumerHead.load(stored.path),
                         TrainingState(initial, OptimizerSettings(lr=1e-3)))
    rows = []
    for step in range(args.steps):
        began = time.perf_counter()
        loss, _tokens, _seconds = local.step(batch)
        rows.append({"step": step + 1, "loss": loss, "seconds": time.perf_counter() - began})
        log(f"one-process step {step + 1}: loss {loss:.6f} in {rows[-1]['seconds']:.1f} s")
    return rows


def local_generation(args, stored, adapter, prompt: list[int]) -> list[int]:
    import torch

    from compushare.spans import load_head, load_span

    runner, head = load_span(stored.path, 0, stored.num_blocks, threads=args.threads), load_head(stored.path)
    cache = runner.new_cache()
    hidden = runner.forward(head.embed_tokens(prompt), cache, 0, adapter=adapter)
    tokens = []
    for _ in range(GENERATED):
        tokens.append(int(torch.argmax(head.logits(hidden))))
        hidden = runner.forward(head.embed_tokens(tokens[-1:]), cache, runner.cached_length(cache), adapter=adapter)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--train-memory-mb", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "finetune_big.jsonl"))
    args = parser.parse_args()

    gguf_path = synthetic_gguf.ensure("llama-3.1-8b", "Q4_K_M", log=log)
    root = Path(tempfile.mkdtemp(prefix="finetune-big-", dir=big_model.resolve_cache_dir().parent))
    env = dict(os.environ, COMPUSHARE_HOME=str(root / "home"), COMPUSHARE_CACHE=str(root / "cache"),
               PYTHONUNBUFFERED="1")
    os.environ.update(COMPUSHARE_HOME=env["COMPUSHARE_HOME"], COMPUSHARE_CACHE=env["COMPUSHARE_CACHE"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the nodes (finally below)
    swarm_home = root / "swarm"
    failed = True
    try:
        result = run(args, gguf_path, root, swarm_home, env)
        failed = False
    finally:
        from compushare.app.swarm import stop_pids

        stop_pids([int(p.read_text()) for p in swarm_home.glob("node-*/node.pid") if p.read_text().strip().isdigit()])
        if failed:
            log(f"failed: its logs and data dirs are kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if failed:
        raise SystemExit(1)
    raise SystemExit(finish(result, args.results or None))


def run(args, gguf_path: Path, root: Path, swarm_home: Path, env: dict) -> dict:
    import subprocess

    import trio

    from compushare.app.swarm import split_blocks
    from compushare.model.lora import Adapter, LoraSpec
    from compushare.model.store import ModelStore
    from compushare.pipeline.server.provider import block_cost

    node0 = swarm_home / "node-0"
    big_model.measured(big_model.cli("models", "import", str(gguf_path), "--name", NAME, "--json", "--data-dir",
                                     str(node0)), env=env, out=root / "import.log", timeout=1800)
    stored = ModelStore(node0).get(NAME)
    spans = split_blocks(stored.num_blocks, 3)
    kv_tokens = 1024
    cost = block_cost(stored, kv_tokens, "ggml")
    budget_mb = big_model.HELD_FLOOR_MB + args.train_memory_mb + (max(e - s for s, e in spans) * cost) // MB + 1
    for i in range(3):
        (swarm_home / f"node-{i}").mkdir(parents=True, exist_ok=True)
        (swarm_home / f"node-{i}" / "config.toml").write_text(f"[limits]\ntrain_memory_mb = {args.train_memory_mb}\n")
    log(f"spans {spans}; budget {budget_mb} MB a node ({cost / MB:.0f} MB a block with {kv_tokens} KV tokens, "
        f"{args.train_memory_mb} MB for training)")
    began = time.monotonic()
    big_model.measured(big_model.cli("swarm", "up", "--nodes", "3", "--model", NAME, "--home", str(swarm_home),
                                     "--memory-budget-mb", str(budget_mb), "--kv-budget", str(kv_tokens),
                                     "--threads", str(args.threads), "--runtime", "ggml"),
                       env=env, out=root / "swarm_up.log", timeout=1800)
    log(f"swarm up in {time.monotonic() - began:.0f} s")
    swarm = json.loads((swarm_home / "swarm.json").read_text())
    try:
        config = stored.manifest.config
        from compushare.model.arch import load_config

        initial = Adapter.initialised(LoraSpec(args.rank, 2.0 * args.rank, TARGETS), load_config(stored.path),
                                      range(stored.num_blocks), seed=0, model_id=stored.model_id)
        batch = training_batch(stored, args.sequences, args.seq_len)
        swarm_rows, adapter, generated, plain, prompt = trio.run(
            swarm_steps, args, root / "consumer", swarm["bootstrap"], stored, initial, batch, root / "adapter.safetensors")
        peaks = [big_model.peak_rss_mb(n["pid"]) for n in swarm["nodes"]]
    finally:
        subprocess.run(big_model.cli("swarm", "down", "--home", str(swarm_home)), env=env, timeout=60,
                       capture_output=True)
    for (start, end), peak in zip(spans, peaks):
        log(f"  node {start}:{end}: peak RSS {peak:.0f} MB against its budget of {budget_mb} MB")
    local_rows = local_steps(args, stored, initial, batch)
    expected = local_generation(args, stored, adapter, prompt)
    log(f"generation with the adapter: swarm {generated}, one process {expected}, without it {plain}")
    swarm_s = sum(r["seconds"] for r in swarm_rows) / len(swarm_rows)
    local_s = sum(r["seconds"] for r in local_rows) / len(local_rows)
    return {
        "bench": "finetune_big", "shape": "llama-3.1-8b", "type": "Q4_K_M", "nodes": 3,
        "spans": [f"{s}:{e}" for s, e in spans], "max_share": max(e - s for s, e in spans) / stored.num_blocks,
        "rank": args.rank, "targets": list(TARGETS), "steps": args.steps, "sequences": args.sequences,
        "seq_len": args.seq_len, "threads": args.threads, "hidden": config["hidden_size"],
        "swarm_losses": [r["loss"] for r in swarm_rows], "local_losses": [r["loss"] for r in local_rows],
        "max_loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in zip(swarm_rows, local_rows)),
        "swarm_step_s": round(swarm_s, 1), "local_step_s": round(local_s, 1),
        "swarm_vs_local": round(local_s / swarm_s, 3),
        "budget_mb": budget_mb, "train_memory_mb": args.train_memory_mb,
        "peak_rss_mb": [round(p) for p in peaks], "within_budget": all(p <= budget_mb for p in peaks),
        "adapter_generation_identical": generated == expected, "adapter_changes_generation": generated != plain,
    }


if __name__ == "__main__":
    main()
