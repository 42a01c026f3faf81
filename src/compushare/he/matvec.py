"""The provider's encrypted matrix products (plan.py's method on SEAL objects).

`EncodedMatrix` holds the plaintexts P[q, o, g, j] of one weight matrix for one
plan, encoded once (at the weight scale, at the inputs' level): encoding costs
~0.4 ms a plaintext, three times the product it serves, so a provider pays it
when it loads, not per token. All-zero plaintexts are not kept (SEAL refuses a
product that is all zero, and it would be wasted work anyway).

A provider may split a product among several worker processes (both cores):
worker i of n holds only its share of the (output, giant step) pairs (whole
outputs where there are enough, else giant steps) and returns, for each output it
touched, its part of the sum. Parts add exactly (modular
integer sums), so the answer is the same ciphertext, byte for byte, whatever the
split: `add` joins them.
"""

from __future__ import annotations

import numpy as np

from .ckks import Context
from .plan import Plan


def share_pairs(plan: Plan, index: int, workers: int) -> list[tuple[int, int]]:
    """The (output, giant step) pairs worker `index` of `workers` computes: whole
    outputs in turn while every worker can have one (nothing to add up after), the
    giant steps of the rest in turn."""
    whole = plan.outputs - plan.outputs % workers
    mine = [(o, g) for o in range(index, whole, workers) for g in range(plan.giant)]
    rest = [(o, g) for o in range(whole, plan.outputs) for g in range(plan.giant)]
    return mine + rest[index::workers]


class EncodedMatrix:
    def __init__(self, context: Context, weight: np.ndarray, plan: Plan, share: tuple[int, int] = (0, 1)) -> None:
        self.plan = plan
        self.pairs = share_pairs(plan, *share)
        self.plain: dict[tuple[int, int], list[tuple[int, int, object]]] = {}
        for o in sorted({o for o, _ in self.pairs}):
            diagonals = plan.diagonals(weight, o)  # [chunks, giant, baby, slots]
            for g in (g for oo, g in self.pairs if oo == o):
                self.plain[(o, g)] = [(q, j, context.encode(diagonals[q, g, j], context.weight_scale))
                                      for q in range(plan.chunks) for j in range(plan.baby)
                                      if np.any(diagonals[q, g, j])]
        self.plaintexts = sum(len(v) for v in self.plain.values())
        self.nbytes = self.plaintexts * context.params.poly_degree * 8 * (len(context.params.coeff_bits) - 1)
        self._babies = sorted({j for terms in self.plain.values() for _, j, _ in terms})

    def apply(self, context: Context, keys, cts: list) -> dict[int, object]:
        """This share's part of each output it touches, for one group's input
        ciphertexts (one a chunk)."""
        seal, ev, plan = context.seal, context.evaluator, self.plan
        if len(cts) != plan.chunks:
            raise ValueError(f"{len(cts)} input ciphertexts for a plan of {plan.chunks} chunks")
        rotated: dict[tuple[int, int], object] = {}
        for q, ct in enumerate(cts):
            for j in self._babies:
                if j == 0:
                    rotated[(q, 0)] = ct
                else:
                    out = seal.Ciphertext()
                    ev.rotate_vector(ct, j, keys, out)
                    rotated[(q, j)] = out
        outputs: dict[int, object] = {}
        for (o, g), terms in self.plain.items():
            inner = None
            for q, j, plain in terms:
                term = seal.Ciphertext()
                ev.multiply_plain(rotated[(q, j)], plain, term)
                if inner is None:
                    inner = term
                else:
                    ev.add_inplace(inner, term)
            if inner is None:
                continue
            # Rescaled first: the giant step's rotation then works on one prime,
            # about half the cost of a rotation at the top level.
            ev.rescale_to_next_inplace(inner)
            if g:
                ev.rotate_vector_inplace(inner, g * plan.baby, keys)
            if o in outputs:
                ev.add_inplace(outputs[o], inner)
            else:
                outputs[o] = inner
        return outputs  # one prime less than the input: half the bytes back


def add(context: Context, parts: list) -> object:
    """The sum of several workers' parts of one output (loaded ciphertexts)."""
    total = parts[0]
    for part in parts[1:]:
        context.evaluator.add_inplace(total, part)
    return total
