"""The provider's encrypted matrix-vector product (plan.py's method on SEAL objects).

`EncodedMatrix` holds the plaintexts P[o, g, j] of one weight matrix, encoded once
(at the weight scale, at the ciphertexts' level): encoding costs ~0.2 ms a plaintext,
several times the product it serves, so a provider pays it when it loads, not per
token. All-zero plaintexts are not kept (SEAL refuses a product that is all zero,
and it would be wasted work anyway).
"""

from __future__ import annotations

import numpy as np

from .ckks import Context
from .plan import Plan, choose


class EncodedMatrix:
    def __init__(self, context: Context, weight: np.ndarray) -> None:
        rows, cols = weight.shape
        self.plan: Plan = choose(rows, cols, context.slots)
        diagonals = self.plan.diagonals(weight)
        self.plain: dict[tuple[int, int, int], object] = {}
        for index in np.ndindex(diagonals.shape[:3]):
            values = diagonals[index]
            if np.any(values):
                self.plain[index] = context.encode(values, context.weight_scale)
        self.plaintexts = len(self.plain)
        for o in range(self.plan.outputs):
            if not any(key[0] == o for key in self.plain):
                raise ValueError(f"output {o} of a {rows} x {cols} product has no nonzero weight")
        self.nbytes = self.plaintexts * context.params.poly_degree * 8 * (len(context.params.coeff_bits) - 1)

    def apply(self, context: Context, keys, ct) -> list:
        """The output ciphertexts (plan.outputs of them) for one input ciphertext."""
        seal, ev, plan = context.seal, context.evaluator, self.plan
        rotated = [ct]
        for j in range(1, plan.baby):
            out = seal.Ciphertext()
            ev.rotate_vector(ct, j, keys, out)
            rotated.append(out)
        outputs = []
        for o in range(plan.outputs):
            total = None
            for g in range(plan.giant):
                inner = None
                for j in range(plan.baby):
                    plain = self.plain.get((o, g, j))
                    if plain is None:
                        continue
                    term = seal.Ciphertext()
                    ev.multiply_plain(rotated[j], plain, term)
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
                if total is None:
                    total = inner
                else:
                    ev.add_inplace(total, inner)
            outputs.append(total)  # one prime less than the input: half the bytes back
        return outputs
