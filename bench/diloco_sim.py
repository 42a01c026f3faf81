"""DiLoCo's arithmetic without the network, against one process: what the algorithm
costs in loss at this scale, apart from anything the swarm does.

    .venv/bin/python bench/diloco_sim.py [--rounds 6] [--warm-steps 0] [--keep-inner-state]
                                         [--outer-lr 0.7] [--momentum 0.9] [--lr 1e-3]

Four workers (peer ids w0..w3) each run diloco/inner.train_round from the outer
weights; their pseudo-gradients are averaged exactly (no int8, no CenteredClip); the
outer optimizer steps. Beside it (in this process, after it), one process trains
with the global batch (4 × the recipe's) for as many steps. With --warm-steps N both
start from N one-process steps (batches of their own seed label); with
--keep-inner-state each worker keeps its AdamW state across rounds (OpenDiLoCo's way;
the swarm restarts it every round so that any round can be re-run). Eval: the mean
loss over 32 held-out batches after each round. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import _common  # noqa: F401  (this checkout's src/)

import torch  # noqa: E402

from compushare.diloco import inner  # noqa: E402
from compushare.diloco.corpus import Corpus, minibatch  # noqa: E402
from compushare.diloco.recipe import Recipe  # noqa: E402

WORKERS = 4
EVAL_BATCHES = 32


def diloco(recipe: Recipe, corpus: Corpus, start: torch.Tensor, keep: bool) -> list[float]:
    models = [inner.build_model(recipe) for _ in range(WORKERS if keep else 1)]
    optimizers = [inner._adamw(recipe, m) for m in models] if keep else []
    weights, outer, history = start.clone(), inner.OuterOptimizer(recipe, start.numel()), []
    for round_ in range(recipe.rounds):
        pseudo = []
        for i in range(WORKERS):
            if keep:  # the worker's own model and AdamW, carried over from its last round
                model, optimizer = models[i], optimizers[i]
                inner.load_flat(model, weights)
                model.train()
                for step in range(recipe.steps):
                    batch = minibatch(corpus, recipe, run_id="sim", peer=f"w{i}", round=round_, step=step)
                    inner._inner_step(recipe, model, optimizer, batch, round_ * recipe.steps + step)
                pseudo.append(weights - inner.flat_params(model))
            else:
                pseudo.append(inner.train_round(recipe, corpus, weights, run_id="sim", peer=f"w{i}", round=round_,
                                                model=models[0]).pseudo_grad)
        weights = outer.step(weights, sum(pseudo) / WORKERS)
        history.append(round(inner.eval_loss(recipe, corpus, weights, batches=EVAL_BATCHES, model=models[0]), 4))
        print(f"round {round_}: eval {history[-1]}", flush=True)
    return history


def rerun_threads(recipe: Recipe, corpus: Corpus, start: torch.Tensor) -> None:
    runs = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        runs[threads] = inner.train_round(recipe, corpus, start, run_id="sim", peer="w0", round=0).pseudo_grad
    torch.set_num_threads(1)
    error = float((runs[2] - runs[1]).norm() / runs[1].norm())
    print(json.dumps({"rerun_threads": [1, 2], "relative_error": error, "bit_equal": torch.equal(runs[1], runs[2])}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warm-steps", type=int, default=0)
    parser.add_argument("--keep-inner-state", action="store_true")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rerun-threads", action="store_true",
                        help="only re-run one round on 1 and on 2 torch threads and compare (what a checker on "
                             "another thread count would see)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    corpus = Corpus.load(_common.REPO / "bench" / "data" / "diloco" / "corpus.txt.gz")
    recipe = dataclasses.replace(Recipe.default_small(corpus.digest), steps=args.steps, rounds=args.rounds,
                                 outer_lr=args.outer_lr, outer_momentum=args.momentum, lr=args.lr)
    began = time.monotonic()
    start = inner.flat_params(inner.build_model(recipe))
    if args.rerun_threads:
        rerun_threads(recipe, corpus, start)
        return
    if args.warm_steps:
        start, _ = inner.train_single(recipe, corpus, global_batch=WORKERS * recipe.batch, steps=args.warm_steps,
                                      seed_label="warm")
    history = diloco(recipe, corpus, start, args.keep_inner_state)
    single, _ = inner.train_single(recipe, corpus, global_batch=WORKERS * recipe.batch,
                                   steps=recipe.steps * recipe.rounds, weights=start)
    loss_single = inner.eval_loss(recipe, corpus, single, batches=EVAL_BATCHES)
    print(json.dumps({"rounds": args.rounds, "H": args.steps, "warm_steps": args.warm_steps,
                      "keep_inner_state": args.keep_inner_state, "outer_lr": args.outer_lr,
                      "momentum": args.momentum, "lr": args.lr, "history": history, "loss_diloco": history[-1],
                      "loss_single": round(loss_single, 4), "loss_ratio": round(history[-1] / loss_single, 4),
                      "seconds": round(time.monotonic() - began, 1)}))


if __name__ == "__main__":
    main()
