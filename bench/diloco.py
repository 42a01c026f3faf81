"""DiLoCo across node processes against one process training alone, in one run.

    .venv/bin/python bench/diloco.py [--steps 50] [--rounds 8] [--batch 8]

The small Llama of diloco/recipe.py (byte-level, trained on bench/data/diloco/: public
domain, provenance in bench/data/README.md), every process on one torch thread:

  diloco  `compushare train start` (A) and `train join` (B, C, D) on 127.0.0.1: four
          honest participants, H inner AdamW steps per round, pseudo-gradients
          averaged in int8 over /compushare/diloco streams (CenteredClip per part),
          outer Nesterov SGD. A fifth (E) sends Gaussian noise of --noise times its
          pseudo-gradient's norm; C is killed (SIGKILL) when the run reaches round
          --kill-at; F joins at round --join-at (the outer state through the torrent
          layer, a zero pseudo-gradient in its first round).
  single  beside them, one process trains the same model with the global batch
          (4 × --batch sequences per step) for the same number of steps (rounds × H),
          AdamW with the inner settings.

Both are scored by the loss on the corpus's held-out bytes. bytes_per_node is what
one participant that stayed the whole run (A, B, D) sent for averaging (its parts,
and the averages of its own part); bytes_ddp_equiv what a ring all-reduce of fp32
gradients after every inner step sends per node for as many steps among 4 nodes:
2·(4−1)/4 · 4 bytes · parameters · steps.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, finish

CORPUS = REPO / "bench" / "data" / "diloco" / "corpus.txt.gz"
NODES = 4  # honest participants at the start


def log(message: str) -> None:
    print(message, flush=True)


def _cli(home: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "compushare", "train", *args, "--corpus", str(CORPUS), "--home", str(home),
            "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "info"]


def _state(home: Path, name: str = "diloco.json") -> dict | None:
    try:
        return json.loads((home / "train" / name).read_text())
    except (OSError, ValueError):
        return None


def _wait(check, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout:.0f}s for {what}")


class Lab:
    """The bench's processes, stopped by pid on every exit path."""

    def __init__(self, root: Path) -> None:
        self.root, self.procs = root, {}

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, COMPUSHARE_HOME=str(home), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
        with (home / "log.txt").open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.procs[name] = proc
        return proc

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def tail(self, name: str) -> str:
        try:
            return (self.root / name / "log.txt").read_text(errors="replace")[-2000:]
        except OSError:
            return ""


def _recipe(args):
    from compushare.diloco.corpus import Corpus
    from compushare.diloco.recipe import Recipe

    corpus = Corpus.load(CORPUS)
    recipe = dataclasses.replace(Recipe.default_small(corpus.digest), steps=args.steps, rounds=args.rounds,
                                 batch=args.batch)
    return recipe, corpus


def warm_start(args, root: Path) -> tuple[str, Path, float]:
    """Both runs' starting point: --warm-steps of the one-process training (global batch),
    laid out in A's store (the run's `init`) and saved for the baseline."""
    import torch
    from safetensors.torch import save_file

    from compushare.diloco.inner import eval_loss, train_single
    from compushare.diloco.weights import store_flat
    from compushare.model.store import ModelStore

    torch.set_num_threads(1)
    recipe, corpus = _recipe(args)
    weights, _loss = train_single(recipe, corpus, global_batch=NODES * args.batch, steps=args.warm_steps,
                                  seed_label="warm")
    store = root / "a" / "train"
    store.mkdir(parents=True, exist_ok=True)
    model_id = store_flat(ModelStore(store), recipe, weights).model_id
    path = root / "warm.safetensors"
    save_file({"weights": weights}, str(path))
    return model_id, path, eval_loss(recipe, corpus, weights)


def run_single(args) -> None:
    """The baseline, in its own process (--single): from the warm start, if any."""
    import torch
    from safetensors.torch import load_file

    from compushare.diloco.inner import eval_loss, train_single

    torch.set_num_threads(1)
    recipe, corpus = _recipe(args)
    start = load_file(args.init)["weights"] if args.init else None
    began = time.monotonic()
    weights, _loss = train_single(recipe, corpus, global_batch=NODES * args.batch, steps=args.steps * args.rounds,
                                  weights=start)
    result = {"loss": eval_loss(recipe, corpus, weights), "seconds": time.monotonic() - began,
              "params": weights.numel(), "tokens": NODES * args.batch * recipe.seq_len * args.steps * args.rounds}
    Path(args.out).write_text(json.dumps(result))


def run_swarm(args, lab: Lab) -> dict:
    common = ["--steps", str(args.steps), "--rounds", str(args.rounds), "--batch", str(args.batch),
              "--check-rate", str(args.check_rate), "--gather-s", str(args.gather_s)]
    init, warm_path, warm_loss = ("", None, None)
    if args.warm_steps:
        init, warm_path, warm_loss = warm_start(args, lab.root)
        log(f"warm start: {args.warm_steps} one-process steps, eval loss {warm_loss:.4f}, model {init[:12]}")
        common += ["--init", init]
    lab.start("a", _cli(lab.root / "a", "start", "--name", "bench", "--start-in", str(args.start_in), *common))
    listen = _wait(lambda: _state(lab.root / "a", "node.listen.json"), "A listening", 120)
    boot = next(a for a in listen["addrs"] if "/ip4/127.0.0.1/" in a)
    boot = boot if "/p2p/" in boot else f"{boot}/p2p/{listen['peer_id']}"
    run_id = _wait(lambda: (_state(lab.root / "a") or {}).get("run"), "the run's id", 120)
    log(f"run {run_id} started by A ({listen['peer_id'][:12]})")
    for name in ("b", "c", "d"):
        lab.start(name, _cli(lab.root / name, "join", run_id, "--bootstrap", boot))
    lab.start("e", _cli(lab.root / "e", "join", run_id, "--bootstrap", boot, "--debug-noise", str(args.noise)))
    single_out = lab.root / "single.json"
    lab.start("single", [sys.executable, __file__, "--single", "--out", str(single_out), "--steps", str(args.steps),
                         "--rounds", str(args.rounds), "--batch", str(args.batch)]
              + (["--init", str(warm_path)] if warm_path else []))
    killed = joined = False
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        round_ = (_state(lab.root / "a") or {}).get("round", 0)
        if not killed and round_ >= args.kill_at:
            lab.procs["c"].send_signal(signal.SIGKILL)
            killed = True
            log(f"round {round_}: killed C")
        if not joined and round_ >= args.join_at:
            lab.start("f", _cli(lab.root / "f", "join", run_id, "--bootstrap", boot))
            joined = True
            log(f"round {round_}: F joins")
        # Not the cheater: excluded, it waits alone for company every round (its state is read as it stands).
        running = [n for n in ("a", "b", "d", "f", "single") if n in lab.procs and lab.procs[n].poll() is None]
        if joined and not running:
            break
        time.sleep(1.0)
    else:
        raise TimeoutError(f"the run did not finish within {args.timeout:.0f}s")
    for name in ("a", "b", "d", "f", "single"):
        if lab.procs[name].returncode != 0:
            raise RuntimeError(f"{name} exited {lab.procs[name].returncode}:\n{lab.tail(name)}")
    states = {n: _state(lab.root / n) for n in ("a", "b", "d", "e", "f")}
    return {"states": states, "single": json.loads(single_out.read_text()), "run": run_id, "warm_loss": warm_loss}


def summarize(args, outcome: dict, seconds: float) -> dict:
    states, single = outcome["states"], outcome["single"]
    stayed = [states[n] for n in ("a", "b", "d")]
    honest = stayed + [states["f"]]
    cheater = states["e"]["peer_id"]
    params = single["params"]
    steps = args.steps * args.rounds
    bytes_per_node = sum(s["sent_bytes"] for s in stayed) / len(stayed)
    ddp = 2 * (NODES - 1) / NODES * 4 * params * steps
    loss_diloco = states["a"]["eval_loss"]
    return {
        "tokens": single["tokens"], "params": params, "steps": args.steps, "loss_diloco": round(loss_diloco, 4),
        "loss_single": round(single["loss"], 4), "loss_ratio": round(loss_diloco / single["loss"], 4),
        "bytes_per_node": int(bytes_per_node), "bytes_ddp_equiv": int(ddp),
        "traffic_reduction": round(ddp / bytes_per_node, 1), "rounds": states["a"]["round"],
        "joined": int(states["f"].get("joined_at") is not None), "joined_at": states["f"].get("joined_at"),
        "left": 1, "left_at": args.kill_at,
        "cheater_excluded": all(cheater in s["excluded"] for s in honest),
        "weights_equal": len({s["base"] for s in honest}) == 1,
        "averaged_rounds": [s["averaged"] for s in honest], "alone_rounds": [s["alone"] for s in honest],
        "reports": sum(s["reports"] for s in honest), "receipts": [s["receipts"] for s in honest],
        "seconds": round(seconds, 1), "single_seconds": round(single["seconds"], 1),
        "warm_steps": args.warm_steps, "loss_warm": round(outcome["warm_loss"], 4) if outcome["warm_loss"] else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--noise", type=float, default=10.0)
    parser.add_argument("--check-rate", type=float, default=0.5)
    parser.add_argument("--gather-s", type=float, default=30.0)
    parser.add_argument("--start-in", type=float, default=45.0, help="seconds from the run's creation to round 0")
    parser.add_argument("--kill-at", type=int, default=3)
    parser.add_argument("--join-at", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1080.0)
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "diloco.jsonl"))
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--warm-steps", type=int, default=300, help="start both runs from this many one-process steps")
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        run_single(args)
        return 0
    root = Path(tempfile.mkdtemp(prefix="cs-diloco-"))
    lab, failed, began = Lab(root), True, time.monotonic()
    try:
        outcome = run_swarm(args, lab)
        failed = False
    finally:
        lab.close()
        if failed:
            for name in lab.procs:
                log(f"--- {name}\n{lab.tail(name)}")
        if args.keep or failed:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result = summarize(args, outcome, time.monotonic() - began)
    for key in ("loss_diloco", "loss_single", "loss_ratio", "traffic_reduction", "cheater_excluded", "weights_equal"):
        log(f"{key}: {result[key]}")
    return finish(result, args.results)


if __name__ == "__main__":
    sys.exit(main())
