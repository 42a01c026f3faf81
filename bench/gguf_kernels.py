"""The cost of each GGUF type's kernel (model/kernels.py): a one-token product at
Llama-3.1-8B's shapes, one thread, weights in memory as the kernel holds them.

    .venv/bin/python bench/gguf_kernels.py [--repeat 30] [--results bench/results/gguf_kernels.jsonl]

Per type and shape: ms per product (median of --repeat), GB/s of the file's bytes
(what a token must read from the store) and of the kernel's own bytes (what it
reads from memory). Random valid blocks: values do not change a kernel's speed.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import finish

SHAPES = ((14336, 4096), (4096, 4096))  # gate / up (down is 4096 x 14336), q / o
TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q8_0", "Q6_K", "F16", "BF16", "F32")


def held_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.buffers())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--results", default="bench/results/gguf_kernels.jsonl")
    args = parser.parse_args()
    import numpy as np
    import torch

    from compushare.model import gguf_native
    from compushare.model.kernels import linear

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rows = []
    for kind in TYPES:
        for out_features, in_features in SHAPES:
            raw = gguf_native.random_rows(kind, out_features, in_features, rng)
            module = linear({"": torch.from_numpy(raw)}, gguf_type=kind)
            x = torch.randn(1, in_features)
            for _ in range(3):
                module(x)
            times = []
            for _ in range(args.repeat):
                began = time.perf_counter()
                module(x)
                times.append(time.perf_counter() - began)
            seconds = statistics.median(times)
            row = {"type": kind, "shape": f"{out_features}x{in_features}", "kernel": type(module).__name__,
                   "ms": round(seconds * 1e3, 3), "file_gb_s": round(raw.nbytes / seconds / 1e9, 2),
                   "held_gb_s": round(held_bytes(module) / seconds / 1e9, 2),
                   "file_bits": round(raw.nbytes * 8 / (out_features * in_features), 2),
                   "held_bits": round(held_bytes(module) * 8 / (out_features * in_features), 2)}
            print(row, flush=True)
            rows.append(row)
            del module, raw
    return finish({"bench": "gguf_kernels", "threads": 1, "torch": torch.__version__, "rows": rows}, args.results)


if __name__ == "__main__":
    raise SystemExit(main())
