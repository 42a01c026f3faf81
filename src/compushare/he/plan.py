"""How one encrypted matrix-vector product is laid out in CKKS slots. Pure numpy.

A provider multiplies a plaintext weight matrix W (rows x cols) by an encrypted
vector x. The consumer encrypts x *replicated*: slot p holds x[p mod period],
where `period` is cols padded with zeros to a multiple of the window. Rotating
that ciphertext left by j (SEAL's rotate_vector) puts x[(p + j) mod period] in
slot p, correctly for every p + j below the slot count, so rotations act like
cyclic shifts of x everywhere but at the very end of the slots.

The product is the baby-step giant-step diagonal method, with one change that
makes packing cheap: the provider does not finish the sums. An output slot s
holds the dot product of one row with a *window* of `window` = baby x giant
consecutive columns (cyclically from s mod period):

    out[s] = sum_g rot(sum_j P[g, j] * rot(x, j), g * baby)[s]

with b - 1 baby-step rotations of the input (shared by every output ciphertext)
and giant - 1 giant-step rotations per output ciphertext. Each row takes
period / window output slots whose windows tile the row, so the consumer adds
those few slots after decrypting (`reduce`). Rows of all the matrices that share
an input (q, k and v; gate and up) fill the same output ciphertexts, so a layer's
four products cost about rows x cols / slots plaintext products in all, plus a
few dozen rotations, instead of one product per diagonal.

`choose` picks the window, split and output count by a cost model (a baby-step
rotation costs about 13 plaintext products, a giant-step one about 7 since it
runs after its inner sum is rescaled to one prime, a returned ciphertext about
40: measured with SEAL on this project's parameters). Provider and consumer both derive the plan
from the shapes alone, so the wire carries no plan a peer could falsify.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

# Costs in plaintext products (multiply_plain: 0.074 ms at N = 8192 with two data
# primes): a baby-step rotation works at the top level (0.94 ms), a giant step's
# after its inner sum was rescaled to one prime (~0.48 ms, plus the rescale).
BABY_ROTATION_COST = 13.0
GIANT_ROTATION_COST = 7.0
RESCALE_COST = 2.0
# One more ciphertext to serialise, send (128 KiB), load, decrypt and decode: ~1.5 ms
# on loopback, more over a slow link.
OUTPUT_COST = 40.0


@dataclasses.dataclass(frozen=True)
class Plan:
    rows: int
    cols: int
    slots: int
    baby: int
    giant: int

    def __post_init__(self) -> None:
        if min(self.rows, self.cols, self.baby, self.giant) < 1:
            raise ValueError(f"bad plan {self}")
        if self.period > self.slots:
            raise ValueError(f"{self.cols} columns padded to {self.period} do not fit {self.slots} slots")

    @property
    def window(self) -> int:
        return self.baby * self.giant

    @property
    def period(self) -> int:
        return -(-self.cols // self.window) * self.window

    @property
    def windows_per_row(self) -> int:
        return self.period // self.window

    @functools.cached_property
    def bases(self) -> np.ndarray:
        """The first output slot of each row a ciphertext holds: t + m * period for
        t < window, as long as the row's last window still ends inside the slots."""
        last = self.slots - self.period
        return np.array([t + m * self.period for m in range(last // self.period + 1)
                         for t in range(self.window) if t + m * self.period <= last], dtype=np.int64)

    @functools.cached_property
    def rows_per_output(self) -> int:
        last = self.slots - self.period
        t = np.arange(min(self.window, last + 1))
        return int(((last - t) // self.period + 1).sum())

    @property
    def outputs(self) -> int:
        return -(-self.rows // self.rows_per_output)

    @property
    def steps(self) -> frozenset[int]:
        """The rotations a provider needs Galois keys for."""
        return frozenset(range(1, self.baby)) | frozenset(g * self.baby for g in range(1, self.giant))

    @property
    def rotations(self) -> int:
        return self.baby - 1 + self.outputs * (self.giant - 1)

    @property
    def products(self) -> int:
        return self.outputs * self.window

    def cost(self) -> float:
        giant = self.outputs * (self.giant - 1)
        return (BABY_ROTATION_COST * (self.baby - 1) + GIANT_ROTATION_COST * giant
                + RESCALE_COST * self.outputs * self.giant + self.products + OUTPUT_COST * self.outputs)

    @functools.cached_property
    def row_slots(self) -> np.ndarray:
        """[rows, windows_per_row]: where (in the outputs laid end to end) each row's
        partial sums are."""
        r = np.arange(self.rows)
        output, which = np.divmod(r, self.rows_per_output)
        base = output * self.slots + self.bases[which]
        return base[:, None] + self.window * np.arange(self.windows_per_row)[None, :]

    def input_slots(self, x: np.ndarray) -> np.ndarray:
        """The replicated layout the consumer encrypts: slot p holds x[p mod period]."""
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.cols,):
            raise ValueError(f"input of shape {x.shape}, plan wants ({self.cols},)")
        padded = np.zeros(self.period)
        padded[:self.cols] = x
        return np.resize(padded, self.slots)

    def diagonals(self, weight: np.ndarray) -> np.ndarray:
        """[outputs, giant, baby, slots]: the plaintexts P[o, g, j] of the product."""
        weight = np.asarray(weight, dtype=np.float64)
        if weight.shape != (self.rows, self.cols):
            raise ValueError(f"weight of shape {weight.shape}, plan wants ({self.rows}, {self.cols})")
        padded = np.zeros((self.rows, self.period))
        padded[:, :self.cols] = weight
        out = np.zeros((self.outputs, self.giant, self.baby, self.slots))
        starts = self.row_slots % self.slots  # output slot s of each (row, window)
        output = self.row_slots // self.slots
        rows = np.broadcast_to(np.arange(self.rows)[:, None], starts.shape)
        for g in range(self.giant):
            p = starts + g * self.baby
            for j in range(self.baby):
                out[output, g, j, p] = padded[rows, (p + j) % self.period]
        return out

    def reduce(self, outputs: np.ndarray) -> np.ndarray:
        """The product from the decrypted output slots [outputs, slots]."""
        flat = np.asarray(outputs, dtype=np.float64).reshape(-1)
        if flat.shape != (self.outputs * self.slots,):
            raise ValueError(f"{flat.shape[0]} output slots, plan makes {self.outputs * self.slots}")
        return flat[self.row_slots].sum(axis=1)

    def simulate(self, diagonals: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The provider's algorithm on plaintext slots (np.roll for rotations): what
        the tests check the layout with, and the reference the CKKS path must match."""
        u = self.input_slots(x)
        rotated = [np.roll(u, -j) for j in range(self.baby)]
        outs = np.zeros((self.outputs, self.slots))
        for o in range(self.outputs):
            for g in range(self.giant):
                inner = sum(diagonals[o, g, j] * rotated[j] for j in range(self.baby))
                outs[o] += np.roll(inner, -g * self.baby)
        return self.reduce(outs)


@functools.lru_cache(maxsize=256)
def choose(rows: int, cols: int, slots: int) -> Plan:
    """The cheapest plan for a rows x cols product in `slots` slots (cost model above)."""
    best: Plan | None = None
    for window in range(1, min(cols, slots) + 1):
        if -(-cols // window) * window > slots:
            continue
        for baby in (d for d in range(1, window + 1) if window % d == 0):
            plan = Plan(rows, cols, slots, baby, window // baby)
            if best is None or plan.cost() < best.cost():
                best = plan
    if best is None:
        raise ValueError(f"a {rows} x {cols} product does not fit {slots} slots")
    return best
