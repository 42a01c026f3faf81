"""How encrypted matrix products are laid out in CKKS slots. Pure numpy.

A provider multiplies a plaintext weight W (rows x cols) by encrypted inputs x
(one per token). Three things pack the work into SEAL's 4,096 complex slots:

- **Two columns a slot.** CKKS slots are complex. Column c of a chunk sits in
  the real part of complex element c, column c + h in its imaginary part (h is
  half the chunk's width); the weight's plaintext holds W[r, c] - i W[r, c + h].
  The real part of their product is W[r, c] x[c] + W[r, c + h] x[c + h]: each
  plaintext product does two multiply-adds a slot, and the consumer decodes real
  parts only. Half the products and half the period of the real layout.
- **Windows.** The baby-step giant-step diagonal method, with the sums left
  unfinished: an output slot s holds one row's dot product with a *window* of
  w = baby x giant consecutive complex elements,

      out[s] = sum_g rot(sum_q sum_j P[q, g, j] * rot(x_q, j), g * baby)[s]

  (b - 1 baby-step rotations per input ciphertext, giant - 1 giant-step rotations
  per output). A row takes period / w slots whose windows tile it, and the
  consumer adds them after decrypting (`reduce`).
- **Tokens.** A decode step has one token: its input is replicated (slot p holds
  y[p mod period]) and rows fill every copy (`tokens == 1`). A prompt packs
  `tokens` > 1 tokens a ciphertext, one per block of period + w - 1 slots (the
  block repeats the token's first w - 1 elements, so a window never reads the
  next token); an output then holds w rows for each of its tokens, and a
  ciphertext's baby-step rotations serve all of them.

An input wider than the slots hold splits into `chunks` column chunks, one input
ciphertext each: their products share the inner sums, so chunks cost inputs and
baby steps, not outputs. A request of T tokens sends ceil(T / tokens) groups of
`chunks` ciphertexts and gets `outputs` ciphertexts back per group.

`choose` picks the plan for a request's token count from two per shape (so the
Galois keys cover a bounded set of rotations): the decode plan and the prompt
plan, whichever the cost model finds cheaper for that count. The model is in units
of one plaintext product and add (0.13 ms at N = 8192 on this project's 2-core
reference machine): rotations, rescales, inputs and outputs are measured
multiples (bench/he.py prints them). Provider and consumer both derive plans from
the shapes alone, so the wire carries no layout a peer could falsify.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

# Costs in plaintext products (multiply_plain + add_inplace, 0.134 ms at N = 8192 with
# two data primes). A baby-step rotation works at the top level (1.29 ms), a giant
# step's after its inner sum was rescaled to one prime (0.67 ms, rescale 0.36 ms).
BABY_ROTATION_COST = 9.6
GIANT_ROTATION_COST = 5.0
RESCALE_COST = 2.7
# One more ciphertext to encode, encrypt, serialise, send and load (an input), or to
# serialise, send, load, decrypt and decode (an output): ~2 ms on loopback.
INPUT_COST = 15.0
OUTPUT_COST = 15.0
# Plans are chosen for a provider that splits a product's outputs over two HE
# workers: each worker rotates the inputs itself (pipeline/server/private_worker.py).
PLAN_WORKERS = 2
MAX_TOKENS_PER_CIPHERTEXT = 3  # a prompt plan holds about this many times the decode plan's plaintexts
MAX_OUTPUTS_PER_GROUP = 64  # so one group's answer fits a frame (64 x 128 KiB)
PROMPT_TOKENS = 64  # what the prompt plan is costed for


@dataclasses.dataclass(frozen=True)
class Plan:
    rows: int
    cols: int
    slots: int
    baby: int
    giant: int
    tokens: int = 1  # tokens a ciphertext (1: replicated, rows in every copy)
    chunks: int = 1  # input ciphertexts a token (column chunks)

    def __post_init__(self) -> None:
        if min(self.rows, self.cols, self.baby, self.giant, self.tokens, self.chunks) < 1:
            raise ValueError(f"bad plan {self}")
        if self.tokens * self.block > self.slots:
            raise ValueError(f"{self.tokens} blocks of {self.block} slots do not fit {self.slots}")
        if self.tokens > 1 and self.period + self.window - 1 > self.slots:
            raise ValueError(f"a block of {self.block} slots does not fit {self.slots}")

    @property
    def window(self) -> int:
        return self.baby * self.giant

    @property
    def width(self) -> int:
        """Real columns a chunk (the last one zero-padded)."""
        return -(-self.cols // self.chunks)

    @property
    def half(self) -> int:
        """Complex elements a chunk: column c and c + half share one."""
        return -(-self.width // 2)

    @property
    def period(self) -> int:
        return -(-self.half // self.window) * self.window

    @property
    def block(self) -> int:
        return self.period if self.tokens == 1 else self.period + self.window - 1

    @property
    def windows_per_row(self) -> int:
        return self.period // self.window

    @property
    def copies(self) -> int:
        """Blocks each token of a packed ciphertext has (its rows spread over them)."""
        return 1 if self.tokens == 1 else (self.slots // self.block) // self.tokens

    @functools.cached_property
    def bases(self) -> np.ndarray:
        """The first output slot of each row an output holds (for its first token)."""
        if self.tokens > 1:
            return np.array([c * self.tokens * self.block + t for c in range(self.copies)
                             for t in range(self.window)], dtype=np.int64)
        last = self.slots - self.period
        return np.array([t + m * self.period for m in range(last // self.period + 1)
                         for t in range(self.window) if t + m * self.period <= last], dtype=np.int64)

    @property
    def rows_per_output(self) -> int:
        return _rows_per_output(self.slots, self.period, self.window, self.tokens)

    @property
    def outputs(self) -> int:
        """Output ciphertexts a group (`tokens` tokens) gets back."""
        return -(-self.rows // self.rows_per_output)

    @property
    def steps(self) -> frozenset[int]:
        """The rotations a provider needs Galois keys for."""
        return frozenset(range(1, self.baby)) | frozenset(g * self.baby for g in range(1, self.giant))

    @property
    def products(self) -> int:
        """Plaintext products a group costs (at most: all-zero plaintexts are skipped)."""
        return self.chunks * self.outputs * self.window

    def groups(self, tokens: int) -> int:
        return -(-tokens // self.tokens)

    def cost(self, workers: int = 1) -> float:
        """Of one group, in plaintext products, with `workers` sharing its outputs'
        work (each rotating the inputs itself)."""
        return _group_cost(self.chunks, self.baby, self.giant, self.outputs, workers)

    def ops(self, workers: int = 1) -> dict[str, float]:
        """One group's operations on each of `workers` workers (COSTS weighs them)."""
        return group_ops(self.chunks, self.baby, self.giant, self.outputs, workers)

    # -- the layout --

    def _complex(self, real: np.ndarray) -> np.ndarray:
        """[..., cols] real -> [..., chunks, period] complex: the chunks' elements."""
        padded = np.zeros(real.shape[:-1] + (self.chunks * self.width,))
        padded[..., :self.cols] = real
        chunks = padded.reshape(real.shape[:-1] + (self.chunks, self.width))
        doubled = np.zeros(real.shape[:-1] + (self.chunks, 2 * self.half))
        doubled[..., :self.width] = chunks
        out = np.zeros(real.shape[:-1] + (self.chunks, self.period), dtype=np.complex128)
        out[..., :self.half] = doubled[..., :self.half] + 1j * doubled[..., self.half:]
        return out

    def input_slots(self, x: np.ndarray) -> np.ndarray:
        """[chunks, slots] complex: what the consumer encrypts for one group of at
        most `tokens` tokens (x: [n, cols])."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.cols or not 1 <= x.shape[0] <= self.tokens:
            raise ValueError(f"input of shape {x.shape}, plan wants (1..{self.tokens}, {self.cols})")
        y = self._complex(x)  # [n, chunks, period]
        if self.tokens == 1:
            return np.stack([np.resize(y[0, q], self.slots) for q in range(self.chunks)])
        out = np.zeros((self.chunks, self.slots), dtype=np.complex128)
        cyclic = np.arange(self.block) % self.period
        for m in range(x.shape[0]):
            for c in range(self.copies):
                start = (c * self.tokens + m) * self.block
                out[:, start:start + self.block] = y[m][:, cyclic]
        return out

    def _places(self, output: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows of `output` and, for each, its windows' first slots [n, tokens, windows]."""
        rows = np.arange(output * self.rows_per_output, min(self.rows, (output + 1) * self.rows_per_output))
        base = self.bases[rows - output * self.rows_per_output]
        offsets = np.arange(self.tokens) * self.block
        windows = self.window * np.arange(self.windows_per_row)
        return rows, base[:, None, None] + offsets[None, :, None] + windows[None, None, :]

    def diagonals(self, weight: np.ndarray, output: int) -> np.ndarray:
        """[chunks, giant, baby, slots] complex: the plaintexts P[q, g, j] of one output."""
        weight = np.asarray(weight, dtype=np.float64)
        if weight.shape != (self.rows, self.cols):
            raise ValueError(f"weight of shape {weight.shape}, plan wants ({self.rows}, {self.cols})")
        rows, starts = self._places(output)
        wc = np.conj(self._complex(weight[rows]))  # [its rows, chunks, period]: W[r, c] - i W[r, c + h]
        local = starts % self.block if self.tokens > 1 else starts  # a window's first element in its token
        out = np.zeros((self.chunks, self.giant, self.baby, self.slots), dtype=np.complex128)
        r = np.broadcast_to(np.arange(len(rows))[:, None, None], starts.shape)
        for g in range(self.giant):
            for j in range(self.baby):
                column = (local + g * self.baby + j) % self.period
                out[:, g, j][:, starts + g * self.baby] = np.moveaxis(wc[r, :, column], -1, 0)
        return out

    @functools.cached_property
    def row_slots(self) -> np.ndarray:
        """[tokens, rows, windows]: where each row's partial sums are, in one
        group's outputs laid end to end."""
        out = np.zeros((self.tokens, self.rows, self.windows_per_row), dtype=np.int64)
        for o in range(self.outputs):
            rows, starts = self._places(o)
            out[:, rows] = np.moveaxis(starts, 1, 0) + o * self.slots
        return out

    def reduce(self, outputs: np.ndarray, tokens: int) -> np.ndarray:
        """[tokens, rows]: the products from a request's decrypted real parts
        [groups x outputs, slots]."""
        groups = self.groups(tokens)
        flat = np.asarray(outputs, dtype=np.float64).reshape(groups, self.outputs * self.slots)
        sums = flat[:, self.row_slots].sum(axis=-1)  # [groups, tokens a group, rows]
        return sums.reshape(groups * self.tokens, self.rows)[:tokens]

    def simulate(self, weight: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The provider's algorithm on plaintext slots (np.roll for rotations): what
        the tests check the layout with, and the reference the CKKS path must match."""
        x = np.atleast_2d(np.asarray(x, dtype=np.float64))
        outs = []
        for start in range(0, x.shape[0], self.tokens):
            u = self.input_slots(x[start:start + self.tokens])
            rotated = [[np.roll(u[q], -j) for j in range(self.baby)] for q in range(self.chunks)]
            for o in range(self.outputs):
                p = self.diagonals(weight, o)
                total = np.zeros(self.slots, dtype=np.complex128)
                for g in range(self.giant):
                    inner = sum(p[q, g, j] * rotated[q][j] for q in range(self.chunks) for j in range(self.baby))
                    total += np.roll(inner, -g * self.baby)
                outs.append(total.real)
        return self.reduce(np.stack(outs), x.shape[0])


def _rows_per_output(slots: int, period: int, window: int, tokens: int) -> int:
    if tokens > 1:
        return window * ((slots // (period + window - 1)) // tokens)
    last = slots - period
    q, r = divmod(last, period)
    top = min(window - 1, last)
    return (min(top, r) + 1) * (q + 1) + max(0, top - r) * q


COSTS = {"inputs": INPUT_COST, "baby_rotations": BABY_ROTATION_COST, "products": 1.0,
         "giant_rotations": GIANT_ROTATION_COST, "rescales": RESCALE_COST, "outputs": OUTPUT_COST}


def group_ops(chunks: int, baby: int, giant: int, outputs: int, workers: int = 1) -> dict[str, float]:
    """The operations of one group on each of `workers` workers: every worker loads
    and rotates the inputs, and does its share of the outputs' work."""
    return {"inputs": chunks, "baby_rotations": chunks * (baby - 1),
            "products": outputs * chunks * baby * giant / workers,
            "giant_rotations": outputs * (giant - 1) / workers, "rescales": outputs * giant / workers,
            "outputs": outputs / workers}


def _group_cost(chunks: int, baby: int, giant: int, outputs: int, workers: int) -> float:
    return sum(COSTS[kind] * n for kind, n in group_ops(chunks, baby, giant, outputs, workers).items())


def _search(rows: int, cols: int, slots: int, *, prompt: bool) -> Plan:
    """The cheapest plan per token (at PLAN_WORKERS workers) of one kind. A prompt
    plan of k tokens a ciphertext holds k times the decode plan's plaintexts (each
    row once per token): k is bounded by MAX_TOKENS_PER_CIPHERTEXT."""
    best: tuple[float, Plan] | None = None
    least = -(-cols // (2 * slots))  # chunks so that one chunk's elements fit the slots
    for chunks in range(least, least + (3 if prompt else 2)):
        half = -(-(-(-cols // chunks)) // 2)
        for window in range(1, half + 1):
            period = -(-half // window) * window
            block = period + window - 1 if prompt else period
            if block > slots:
                continue
            most = min(slots // block, MAX_TOKENS_PER_CIPHERTEXT) if prompt else 1
            for tokens in range(2 if prompt else 1, most + 1):
                outputs = -(-rows // _rows_per_output(slots, period, window, tokens))
                if outputs > MAX_OUTPUTS_PER_GROUP:
                    continue
                groups = -(-PROMPT_TOKENS // tokens) if prompt else 1
                for baby in (d for d in range(1, window + 1) if window % d == 0):
                    # A prompt plan is costed for its CPU on one worker: a prompt keeps
                    # every provider of the route busy at once, so the cores are shared
                    # anyway. A decode step's one group is costed for its wall time, its
                    # outputs shared out among PLAN_WORKERS workers.
                    cost = groups * _group_cost(chunks, baby, window // baby, outputs, 1 if prompt else PLAN_WORKERS)
                    if best is None or cost < best[0]:
                        best = (cost, Plan(rows, cols, slots, baby, window // baby, tokens, chunks))
    if best is None:
        raise ValueError(f"no {'prompt' if prompt else 'decode'} plan for a {rows} x {cols} product in {slots} slots")
    return best[1]


@functools.lru_cache(maxsize=256)
def decode_plan(rows: int, cols: int, slots: int) -> Plan:
    return _search(rows, cols, slots, prompt=False)


@functools.lru_cache(maxsize=256)
def prompt_plan(rows: int, cols: int, slots: int) -> Plan | None:
    """None where no block of two tokens fits (then prompts use the decode plan)."""
    try:
        return _search(rows, cols, slots, prompt=True)
    except ValueError:
        return None


def plans(rows: int, cols: int, slots: int) -> tuple[Plan, ...]:
    """Every plan a shape's requests may use (their rotations need Galois keys)."""
    prompt = prompt_plan(rows, cols, slots)
    return (decode_plan(rows, cols, slots),) + ((prompt,) if prompt is not None else ())


def request_tokens(rows: int, cols: int, slots: int, *, max_tokens: int, max_inputs: int, max_outputs: int) -> int:
    """The most tokens one request may carry so that whichever plan it gets sends at
    most `max_inputs` ciphertexts and gets at most `max_outputs` back."""
    most = max_tokens
    for plan in plans(rows, cols, slots):
        most = min(most, plan.tokens * min(max_inputs // plan.chunks, max_outputs // plan.outputs))
    if most < 1:
        raise ValueError(f"a {rows} x {cols} product does not fit one request")
    return most


def choose(rows: int, cols: int, slots: int, tokens: int = 1) -> Plan:
    """The plan of a request of `tokens` tokens: the cheaper of the shape's two."""
    if tokens < 1:
        raise ValueError(f"{tokens} tokens")
    decode = decode_plan(rows, cols, slots)
    prompt = prompt_plan(rows, cols, slots)
    if tokens == 1 or prompt is None:
        return decode
    return min((decode, prompt), key=lambda p: p.groups(tokens) * p.cost())
