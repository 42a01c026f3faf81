"""How far multi-token steps and batched steps are from one-token steps, and what a
batch-invariant forward would cost, on the real SmolLM2 (fp32, 1 thread, in-process).

    .venv/bin/python bench/batch_invariance.py [--prompts 5] [--tokens 64] [--k 4]

reference  per prompt (chat template), greedy decoding one token per forward through
           all 30 blocks (model/blocks.SpanRunner) and the consumer's head: the logits
           and tokens every other path is compared with.
verify     the same tokens fed k at a time, as speculation's verify passes do when
           every draft is kept (k-row forwards, so the KV cache is built from them
           too): per position, is the argmax still the reference token, and how far
           are the logits (relative L2)?
batch      the prompts' decode steps run together, one forward per step for all
           sessions (model/batched.decode_batch, as a server batches concurrent
           sessions): the same comparison.
margin     the reference's gap between its best and second-best logit, so the
           differences above can be read against it (a token flips only where the
           gap is smaller than the error).
cost       what batch invariance costs with the kernels at hand: torch's CPU matmul
           rounds a row differently with the number of rows, so a forward that gives
           the same bits for a token alone, in a chunk or in a batch must compute
           every row as a row alone (one-row products), i.e. a k-token step costs k
           one-token forwards: `invariant_cost_ratio` = k one-token forwards / one
           k-token forward, and `batch_invariant_cost_ratio` the same for a batch.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import _common  # noqa: E402, F401  (this checkout's src/)

import torch  # noqa: E402

from compushare.model.batched import decode_batch  # noqa: E402
from compushare.model.blocks import SpanRunner  # noqa: E402
from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.model.head import ConsumerHead  # noqa: E402
from compushare.proofs.inference import relative_error  # noqa: E402

MODEL = "smollm2-135m"
PROMPTS = [
    "Name three rivers of Europe and one fact about each.",
    "Write a haiku about autumn leaves.",
    "Explain what a hash function is to a child.",
    "List five prime numbers and say why they are prime.",
    "What is the capital of France, and what is it known for?",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Describe the water cycle in three sentences.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="tokens per verify pass")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="compushare-invariance-") as tmp:
        model = resolve_model(MODEL, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(str(model.path))
        runner = SpanRunner.load(model.path, 0, model.num_blocks)
        head = ConsumerHead.load(model.path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for p in PROMPTS[:args.prompts]]

    def prefill(ids):
        cache = runner.new_cache()
        hidden = runner.forward(head.embed_tokens(ids), cache, 0)
        return cache, hidden

    # Reference: one token per forward.
    refs, margins, single_s = [], [], []
    for ids in prompts:
        cache, hidden = prefill(ids)
        logits, tokens = [], []
        token = int(torch.argmax(head.logits(hidden)))
        for _ in range(args.tokens):
            tokens.append(token)
            began = time.perf_counter()
            hidden = runner.forward(head.embed_tokens([token]), cache, runner.cached_length(cache))
            single_s.append(time.perf_counter() - began)
            row = head.logits(hidden)
            logits.append(row)
            top = torch.topk(row, 2).values
            margins.append(float(top[0] - top[1]))
            token = int(torch.argmax(row))
        refs.append((tokens, logits))

    # Verify passes: the reference tokens k at a time (all drafts kept).
    verify_flips = verify_positions = 0
    verify_err, chunk_s = [], []
    for ids, (tokens, logits) in zip(prompts, refs):
        cache, _ = prefill(ids)
        for offset in range(0, args.tokens - args.k + 1, args.k):
            chunk = tokens[offset:offset + args.k]
            began = time.perf_counter()
            hidden = runner.forward(head.embed_tokens(chunk), cache, runner.cached_length(cache))
            chunk_s.append(time.perf_counter() - began)
            rows = head.logits_rows(hidden)
            for i in range(args.k):
                expected = logits[offset + i]
                verify_err.append(relative_error(rows[i].numpy(), expected.numpy()))
                verify_positions += 1
                verify_flips += int(torch.argmax(rows[i])) != int(torch.argmax(expected))

    # Batches: every prompt's decode steps in one forward per step.
    batch_flips = batch_positions = 0
    batch_err, batch_s = [], []
    caches = [prefill(ids)[0] for ids in prompts]
    for step in range(args.tokens):
        xs = [head.embed_tokens([tokens[step]]) for tokens, _ in refs]
        began = time.perf_counter()
        outs = decode_batch(runner, xs, caches, [runner.cached_length(c) for c in caches], 0, model.num_blocks)
        batch_s.append(time.perf_counter() - began)
        for out, (_, logits) in zip(outs, refs):
            row = head.logits(out)
            batch_err.append(relative_error(row.numpy(), logits[step].numpy()))
            batch_positions += 1
            batch_flips += int(torch.argmax(row)) != int(torch.argmax(logits[step]))

    one = statistics.median(single_s)
    result = {
        "model": MODEL, "prompts": len(prompts), "tokens": args.tokens, "k": args.k,
        "verify_positions": verify_positions, "verify_flips": verify_flips,
        "verify_logit_err_median": float(f"{statistics.median(verify_err):.3g}"),
        "verify_logit_err_max": float(f"{max(verify_err):.3g}"),
        "batch_positions": batch_positions, "batch_flips": batch_flips,
        "batch_logit_err_median": float(f"{statistics.median(batch_err):.3g}"),
        "batch_logit_err_max": float(f"{max(batch_err):.3g}"),
        "margin_min": round(min(margins), 4), "margin_p1": round(sorted(margins)[len(margins) // 100], 4),
        "margins_under_1e-2": sum(m < 1e-2 for m in margins),
        "one_token_forward_ms": round(1000 * one, 2),
        "k_token_forward_ms": round(1000 * statistics.median(chunk_s), 2),
        "batch_forward_ms": round(1000 * statistics.median(batch_s), 2),
        "invariant_cost_ratio": round(args.k * one / statistics.median(chunk_s), 2),
        "batch_invariant_cost_ratio": round(len(prompts) * one / statistics.median(batch_s), 2),
    }
    print(f"verify passes of {args.k}: {verify_flips} of {verify_positions} greedy tokens flipped; logits "
          f"{result['verify_logit_err_median']:.2g} (max {result['verify_logit_err_max']:.2g}) from one-token steps")
    print(f"batches of {len(prompts)}: {batch_flips} of {batch_positions} flipped; logits "
          f"{result['batch_logit_err_median']:.2g} (max {result['batch_logit_err_max']:.2g})")
    print(f"reference top-2 margin: min {result['margin_min']}, 1st percentile {result['margin_p1']}")
    print(f"a {args.k}-token forward {result['k_token_forward_ms']} ms vs {args.k} one-token forwards "
          f"{args.k * result['one_token_forward_ms']:.1f} ms (x{result['invariant_cost_ratio']} for invariance); "
          f"a batch of {len(prompts)} {result['batch_forward_ms']} ms vs {len(prompts) * one * 1000:.1f} ms "
          f"(x{result['batch_invariant_cost_ratio']})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
