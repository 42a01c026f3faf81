"""Fine-tuning through the swarm against the same training in one process.

    .venv/bin/python bench/finetune.py [--format fp32|q4|gguf] [--steps 20] [--seq-len 64] [--batch-size 4]
                                       [--accumulate 2]

LoRA (rank 8, alpha 16, on every projection of every block) on SmolLM2-135M in
--format (fp32 by default; q4: our 4-bit format on torch; gguf: its GGUF file's own
Q4_1 tensors, served on ggml, trained on torch a layer at a time, its adapter applied
on ggml),
trained on bench/data/pd_english.txt (public domain: bench/data/README.md) cut
into sequences of --seq-len tokens, a tenth held out for evaluation (the split of
`compushare finetune`, model/train_data.py), the same batches in the same order
for both runs, AdamW lr 1e-3:

  swarm  3 node processes on 127.0.0.1 serving blocks 0:10, 10:20, 20:30; this
         process is the consumer (embeddings, head, loss, optimizer) and drives
         SwarmTrainer: microbatches pipelined through the spans, every backward
         recomputing its span's forward on its server (/compushare/train/1.0.0);
  local  LocalTrainer: every block in this process, one autograd graph per
         microbatch, no recompute (how a machine holding the model trains).

Steps alternate (swarm step k, local step k, ...), so machine noise falls on both
alike; one torch thread in every process. tok/s counts the loss's targets of a
step over its wall time. Spot checks are off (no span has a second server here).
The per-step loss difference of the two runs, evaluation loss before and after
(the swarm's adapter; the local one's beside it), and the adapter's size on disk.
Then the trained adapter in use: 32 greedy tokens through the swarm with it
(`run --adapter`: every server applies it in its KV-cached path) against the same
adapter applied in this process.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (this checkout's src/)

import torch  # noqa: E402
import trio  # noqa: E402

from compushare.model import adapter_file  # noqa: E402
from compushare.model.arch import load_config  # noqa: E402
from compushare.model.blocks import SpanRunner  # noqa: E402
from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.model.head import ConsumerHead  # noqa: E402
from compushare.model.local_training import LocalTrainer  # noqa: E402
from compushare.model.lora import Adapter, LoraSpec  # noqa: E402
from compushare.model.tokenizer import load_tokenizer  # noqa: E402
from compushare.model.train_data import batches, load_examples, split_examples  # noqa: E402
from compushare.model.training_state import OptimizerSettings, TrainingState  # noqa: E402
from compushare.spans import load_span  # noqa: E402
from compushare.pipeline.client.consumer import Consumer, RunRequest, prompt_ids_of  # noqa: E402
from compushare.pipeline.client.sampling import SamplingParams  # noqa: E402
from compushare.pipeline.client.finetune import step_batches  # noqa: E402
from compushare.pipeline.client.planner import SwarmPlanner  # noqa: E402
from compushare.pipeline.client.swarm_trainer import SwarmTrainer  # noqa: E402
from local_swarm import LocalSwarm  # noqa: E402

MODEL = "smollm2-135m"
DATA = _common.REPO / "bench" / "data" / "pd_english.txt"
RESULTS = _common.REPO / "bench" / "results" / "finetune.jsonl"
SPEC = LoraSpec(8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
LR = 1e-3
SEED = 0
GENERATED = 32


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def model_name(fmt: str) -> str:
    return MODEL if fmt == "fp32" else f"{MODEL}@{fmt}"


async def run(args, root: Path, swarm: LocalSwarm) -> dict:
    client_dir = root / "client"
    name = model_name(args.format)
    model = resolve_model(name, client_dir)
    config = load_config(model.path)
    examples = load_examples(DATA, load_tokenizer(model), args.seq_len)
    train, held = split_examples(examples, seed=SEED)
    held_batches = batches(held, args.batch_size)
    log(f"{len(train)} training and {len(held)} held-out sequences of up to {args.seq_len} tokens")
    initial = Adapter.initialised(SPEC, config, range(config.num_hidden_layers), seed=SEED, model_id=model.model_id)
    settings = OptimizerSettings(lr=LR)
    local = LocalTrainer(SpanRunner.load(model.path, 0, config.num_hidden_layers), ConsumerHead.load(model.path),
                         TrainingState(initial, settings))
    bootstrap = tuple(swarm.addrs()[:1])
    async with Consumer.connect(client_dir, bootstrap, name) as consumer:
        planner = SwarmPlanner(consumer.host, consumer.dht, model.model_id, model.num_blocks,
                               penalties=consumer.penalties, view=consumer.view, karma=consumer.karma,
                               fmt=model.format.label)
        trainer = SwarmTrainer(consumer.host, planner, model.model_id, consumer.head, TrainingState(initial, settings),
                               spot_check_rate=0.0)
        await trainer.open()
        log("route: " + ", ".join(f"{s.start}:{s.end}" for s in trainer.stages))
        began = time.perf_counter()
        before = await trainer.evaluate(held_batches)
        log(f"held-out loss before: {before:.4f} ({time.perf_counter() - began:.1f}s)")
        rows = []
        for step in range(args.steps):
            microbatches = step_batches(train, step, args.batch_size, args.accumulate, SEED)
            stats = await trainer.step(microbatches)
            local_loss, local_tokens, local_s = await trio.to_thread.run_sync(local.step, microbatches)
            rows.append({"step": step + 1, "swarm_loss": stats.loss, "local_loss": local_loss,
                         "tokens": stats.tokens, "swarm_s": stats.seconds, "local_s": local_s})
            log(f"step {step + 1:3d}: loss swarm {stats.loss:.6f} local {local_loss:.6f} "
                f"(diff {abs(stats.loss - local_loss):.1e}); {stats.tokens / stats.seconds:.0f} vs "
                f"{local_tokens / local_s:.0f} tok/s")
        after = await trainer.evaluate(held_batches)
        local_after = await trio.to_thread.run_sync(local.evaluate, held_batches)
        adapter_path = root / "adapter.safetensors"
        adapter_file.save(trainer.state.adapter(), adapter_path, base_model=MODEL)
        await trainer.close()
        # The trained adapter in use: greedy tokens through the swarm (every server applying
        # it in its KV-cached path) against the same adapter in this process (on ggml, as
        # the servers, for a GGUF: their runtime's rounding is not torch's).
        prompt = "Alice was beginning to get very tired of"
        request = RunRequest(model=name, prompt=prompt, chat_template=False, adapter=adapter_path,
                             params=SamplingParams(max_new_tokens=GENERATED, stop_at_eos=False))
        outcome = await consumer.generate(request)
        plain = await consumer.generate(dataclasses.replace(request, adapter=None))
        runner = load_span(model.path, 0, config.num_hidden_layers) if args.format == "gguf" else local.runner
        expected = await trio.to_thread.run_sync(local_greedy, runner, consumer.head,
                                                 prompt_ids_of(consumer.tokenizer, request), adapter_file.load(adapter_path))
        log(f"greedy with the adapter, swarm: {outcome.text!r}")
        log(f"without it: {plain.text!r}")
    return summary(args, rows, train, held, before, after, local_after, adapter_path, (outcome, plain, expected))


def summary(args, rows, train, held, before, after, local_after, adapter_path, generated) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    swarm_tok_s = tokens / sum(r["swarm_s"] for r in rows)
    local_tok_s = tokens / sum(r["local_s"] for r in rows)
    result = {
        "bench": "finetune", "model": MODEL, "format": args.format, "nodes": 3, "rank": SPEC.rank,
        "targets": list(SPEC.targets), "seq_len": args.seq_len, "batch_size": args.batch_size,
        "accumulate": args.accumulate, "lr": LR, "steps": args.steps, "train_sequences": len(train),
        "held_out_sequences": len(held),
        "max_loss_diff": max(abs(r["swarm_loss"] - r["local_loss"]) for r in rows),
        "swarm_tok_s": round(swarm_tok_s, 1), "local_tok_s": round(local_tok_s, 1),
        "swarm_vs_local": round(swarm_tok_s / local_tok_s, 3),
        "median_step_s": {"swarm": round(statistics.median(r["swarm_s"] for r in rows), 2),
                          "local": round(statistics.median(r["local_s"] for r in rows), 2)},
        "eval_loss_before": round(before, 4), "eval_loss_after": round(after, 4),
        "eval_ratio": round(after / before, 3), "local_eval_loss_after": round(local_after, 4),
        "adapter_bytes": adapter_path.stat().st_size,
        "first_loss": rows[0]["swarm_loss"], "last_loss": rows[-1]["swarm_loss"],
        "adapter_loads_in_peft": _loads_in_peft(adapter_path),
    }
    if generated is not None:
        outcome, plain, expected = generated
        result.update(adapter_generation_identical=outcome.tokens == expected,
                      adapter_changes_generation=outcome.tokens != plain.tokens, generated_tokens=len(outcome.tokens))
    return result


def _loads_in_peft(path: Path) -> bool:
    """Whether PEFT takes the trained adapter's tensors as a LoRA state dict of its own."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from compushare.model.catalog import resolve_model as resolve

    config = AutoConfig.from_pretrained(str(resolve(MODEL, path.parent / "peft-check").path))
    with torch.random.fork_rng():
        model = AutoModelForCausalLM.from_config(config)
    peft_model = get_peft_model(model, LoraConfig(r=SPEC.rank, lora_alpha=SPEC.alpha,
                                                  target_modules=list(SPEC.targets), lora_dropout=0.0))
    tensors = adapter_file.load(path).tensors
    result = set_peft_model_state_dict(peft_model, {f"base_model.model.{k}": v for k, v in tensors.items()})
    return not [k for k in result.unexpected_keys if "lora_" in k]


def local_greedy(runner, head, prompt_ids: list[int], adapter: Adapter) -> list[int]:
    """Greedy tokens in this process: every block with the adapter, the head beside it."""
    cache = runner.new_cache()
    hidden = runner.forward(head.embed_tokens(prompt_ids), cache, 0, adapter=adapter)
    tokens = []
    for _ in range(GENERATED):
        tokens.append(int(torch.argmax(head.logits(hidden))))
        hidden = runner.forward(head.embed_tokens(tokens[-1:]), cache, runner.cached_length(cache), adapter=adapter)
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--format", choices=("fp32", "q4", "gguf"), default="fp32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--results", default=str(RESULTS), help="JSON-lines history ('' to keep nothing)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as every node process computes
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt("SIGTERM")))
    root = Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    swarm = LocalSwarm(root / "nodes", model_name(args.format), {"a": (0, 10), "b": (10, 20), "c": (20, 30)})
    try:
        began = time.perf_counter()
        resolve_model(model_name(args.format), root / "client")  # converted once into the shared cache, then linked
        swarm.start_all()
        log(f"swarm up in {time.perf_counter() - began:.1f}s")
        result = trio.run(run, args, root, swarm)
    finally:
        swarm.close()
        if not args.keep:
            with contextlib.suppress(OSError):
                shutil.rmtree(root)
    return _common.finish(result, args.results)


if __name__ == "__main__":
    sys.exit(main())
