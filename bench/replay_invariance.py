"""Can a replay in multi-token steps be bit-identical to the one-token steps it
repeats? Blocks 0:15 of SmolLM2 in each weight format, in this process (1 thread).

    .venv/bin/python bench/replay_invariance.py [--formats fp32 q4] [--prompt 200] [--steps 60]

reference  a `--prompt`-token prefill, then `--steps` one-token steps (a failover's
           history as first computed: what a bit-exact replay repeats one by one).
k tokens   the same history replayed with the steps k at a time (k = 2, 3, 4, 8, all),
           and as one forward of everything (`one_forward`): per k, whether the
           outputs are bit-identical to the reference and their relative L2 error.
           The inputs are random hidden states (scale 0.5), the same for every k.

What it decides: a fast replay (RunRequest.fast_replay) can be exact only if these
are identical; otherwise it is exact within the format's tolerance (proofs.inference.TOLERANCES)
and stays opt-in (docs/architecture.md, "Fast failover at any length").

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

from _common import REPO  # noqa: E402  (this checkout's src/)

import torch  # noqa: E402

from compushare.model.blocks import SpanRunner  # noqa: E402
from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.proofs.inference import TOLERANCES, relative_error  # noqa: E402

NAMES = {"fp32": "smollm2-135m", "q4": "smollm2-135m@q4"}


def measure(runner: SpanRunner, prompt: int, steps: int) -> dict:
    hidden = torch.randn(1, prompt + steps, runner.hidden_size) * 0.5
    cache = runner.new_cache()
    outputs = [runner.forward(hidden[:, :prompt], cache, 0)]
    began = time.perf_counter()
    outputs += [runner.forward(hidden[:, i:i + 1], cache, i) for i in range(prompt, prompt + steps)]
    result = {"steps_s": round(time.perf_counter() - began, 3)}
    reference = torch.cat(outputs, dim=1)

    def compare(output: torch.Tensor) -> dict:
        return {"identical": bool(torch.equal(output, reference)),
                "rel_err": float(f"{relative_error(output.numpy(), reference.numpy()):.3g}")}

    for k in (2, 3, 4, 8, steps):
        cache = runner.new_cache()
        parts = [runner.forward(hidden[:, :prompt], cache, 0)]
        parts += [runner.forward(hidden[:, i:min(prompt + steps, i + k)], cache, i)
                  for i in range(prompt, prompt + steps, k)]
        result[f"k{k}"] = compare(torch.cat(parts, dim=1))
    began = time.perf_counter()
    result["one_forward"] = compare(runner.forward(hidden, runner.new_cache(), 0))
    result["one_forward"]["s"] = round(time.perf_counter() - began, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["fp32", "q4"], choices=sorted(NAMES))
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    result: dict = {"model": "smollm2-135m", "blocks": "0:15", "prompt": args.prompt, "steps": args.steps}
    for fmt in args.formats:
        model = resolve_model(NAMES[fmt], REPO / ".cache" / "client")
        row = measure(SpanRunner.load(model.path, 0, 15), args.prompt, args.steps)
        row["tolerance"] = TOLERANCES[model.format.label]
        result[fmt] = row
        print(fmt, ", ".join(f"{k}: {'identical' if v['identical'] else v['rel_err']}" for k, v in row.items()
                             if isinstance(v, dict)), flush=True)
    result["any_identical"] = any(v["identical"] for fmt in args.formats for v in result[fmt].values()
                                  if isinstance(v, dict))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
