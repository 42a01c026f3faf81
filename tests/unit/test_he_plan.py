"""he/plan.py, pure numpy: every plan (two columns a complex slot, tokens packed a
ciphertext or replicated, inputs split in chunks) computes W @ x for any shape and
token count; rows never share an output slot, every window reads its own token's
elements only, and `choose` takes the cheapest plan of its cost model.

Property tests are derandomized: the same examples every run.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compushare.he import plan as plan_module
from compushare.he.plan import (MAX_OUTPUTS_PER_GROUP, PLAN_WORKERS, Plan, choose, decode_plan, plans, prompt_plan,
                                request_tokens)

pytestmark = pytest.mark.unit

SLOTS = 4096  # N = 8192 (ckks.PARAMETER_SETS)
# SmolLM2-135M: qkv, o, gate_up, down; Qwen2.5-0.5B's (down: 4,864 columns, more than the slots);
# the tiny test Llama's.
SMOL = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
QWEN05 = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
TINY = [(64, 64), (128, 64), (256, 64), (64, 128)]
LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3.1-8B's groups

shapes = st.tuples(st.integers(1, 300), st.integers(1, 700))


def check_layout(plan: Plan) -> None:
    """The structural properties every plan must have."""
    slots, window, period, block = plan.slots, plan.window, plan.period, plan.block
    row_slots = plan.row_slots
    assert row_slots.shape == (plan.tokens, plan.rows, plan.windows_per_row)
    flat = row_slots.ravel()
    # No two (token, row, window) partial sums share an output slot.
    assert np.unique(flat).size == flat.size
    assert flat.min() >= 0 and flat.max() < plan.outputs * slots
    local = row_slots % slots
    # A window's sum reads slots s .. s + window - 1 of its ciphertext: all inside the
    # slots, and (tokens packed) inside its token's block.
    assert np.all(local + window <= slots)
    if plan.tokens > 1:
        assert np.all(local // block == (local + window - 1) // block)
        token_of_slot = (local // block) % plan.tokens
        np.testing.assert_array_equal(token_of_slot, np.broadcast_to(np.arange(plan.tokens)[:, None, None],
                                                                     local.shape))
    # The windows of a row tile its period: offsets t, t + w, t + 2w, ... from one t < w.
    offsets = (local % block) % period
    first = offsets[..., :1]
    assert np.all(first < window)
    np.testing.assert_array_equal(offsets - first, np.broadcast_to(window * np.arange(plan.windows_per_row),
                                                                   offsets.shape))
    assert period % window == 0 and plan.half <= period and plan.tokens * block <= slots
    assert 2 * plan.half * plan.chunks >= plan.cols
    assert (plan.outputs - 1) * plan.rows_per_output < plan.rows <= plan.outputs * plan.rows_per_output
    assert plan.rows_per_output == len(plan.bases)
    # Galois keys are needed for exactly the baby and giant steps, none of them 0 or past the slots.
    assert plan.steps == frozenset(range(1, plan.baby)) | {g * plan.baby for g in range(1, plan.giant)}
    assert all(0 < s < slots for s in plan.steps)


def check_product(plan: Plan, seed: int, tokens: int) -> None:
    rng = np.random.default_rng(seed)
    weight = rng.normal(0, 0.05, (plan.rows, plan.cols))
    x = rng.normal(0, 1, (tokens, plan.cols))
    x[:, rng.integers(plan.cols)] = rng.choice([-50.0, 50.0])  # an activation outlier
    expected = x @ weight.T
    got = plan.simulate(weight, x)
    assert got.shape == (tokens, plan.rows)
    assert np.linalg.norm(got - expected) <= 1e-9 * max(np.linalg.norm(expected), 1e-300)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(shapes, st.sampled_from([512, 1024]), st.integers(1, 7), st.integers(0, 2**32 - 1))
def test_chosen_plans_of_random_shapes_compute_the_product(shape, slots, tokens, seed):
    plan = choose(*shape, slots, tokens)
    check_layout(plan)
    check_product(plan, seed, tokens)


@pytest.mark.parametrize("shape", SMOL + TINY, ids=[f"{r}x{c}" for r, c in SMOL + TINY])
def test_both_plans_of_the_model_shapes_compute_the_product(shape):
    for plan in plans(*shape, SLOTS):
        check_layout(plan)
        check_product(plan, seed=shape[0] * 7919 + shape[1], tokens=plan.tokens + 1)


def test_a_qwen05_product_wider_than_the_slots_splits_in_chunks():
    """Qwen2.5-0.5B's down projection: 4,864 columns, 2,432 complex elements; its
    prompt plan splits them to pack tokens. Checked on a slice of the rows (the
    layout of a row does not depend on how many there are)."""
    decode, prompt = decode_plan(*QWEN05[3], SLOTS), prompt_plan(*QWEN05[3], SLOTS)
    assert prompt is not None and prompt.chunks >= 2 and prompt.tokens > 1
    for plan in (decode, prompt):
        small = Plan(64, plan.cols, SLOTS, plan.baby, plan.giant, plan.tokens, plan.chunks)
        check_layout(small)
        check_product(small, seed=5, tokens=small.tokens + 1)
    for shape in QWEN05:
        assert all(p.outputs <= MAX_OUTPUTS_PER_GROUP for p in plans(*shape, SLOTS))


@settings(max_examples=40, derandomize=True, deadline=None)
@given(st.integers(1, 200), st.integers(1, 600), st.integers(1, 12), st.integers(1, 12), st.integers(1, 4),
       st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_any_valid_plan_computes_the_product(rows, cols, baby, giant, tokens, chunks, seed):
    """Not only the chosen ones: the layout is right for every plan the constructor
    accepts (what a change of the cost model could pick)."""
    try:
        plan = Plan(rows, cols, 512, baby, giant, tokens, chunks)
    except ValueError:
        return
    check_layout(plan)
    check_product(plan, seed, tokens=2 * tokens + 1)


def test_two_columns_share_a_complex_slot():
    plan = Plan(3, 7, 64, 1, 1)  # half 4: columns c and c + 4 in element c
    u = plan.input_slots(np.arange(1, 8, dtype=float)[None])
    assert u.shape == (1, 64) and u.dtype == np.complex128
    np.testing.assert_array_equal(u[0, :4], [1 + 5j, 2 + 6j, 3 + 7j, 4])
    np.testing.assert_array_equal(u[0, 4:8], u[0, :4])  # replicated
    packed = Plan(3, 7, 64, 2, 1, tokens=3)
    v = packed.input_slots(np.stack([np.arange(1, 8.0), 10 * np.arange(1, 8.0)]))
    block = packed.block  # period 4 + window 2 - 1
    np.testing.assert_array_equal(v[0, :block], [1 + 5j, 2 + 6j, 3 + 7j, 4, 1 + 5j])
    np.testing.assert_array_equal(v[0, block:2 * block], 10 * v[0, :block])
    assert not np.any(v[0, 2 * block:3 * block])  # the third token's block: no token


def cheapest(rows: int, cols: int, slots: int, chunks: int) -> float:
    """Exhaustively: the least decode cost over every window and split at `chunks`."""
    best = float("inf")
    half = -(-(-(-cols // chunks)) // 2)
    for window in range(1, 2 * half + 1):
        for baby in (b for b in range(1, window + 1) if window % b == 0):
            try:
                plan = Plan(rows, cols, slots, baby, window // baby, 1, chunks)
            except ValueError:
                continue
            if plan.outputs <= MAX_OUTPUTS_PER_GROUP:
                best = min(best, plan.cost(PLAN_WORKERS))
    return best


@pytest.mark.parametrize("shape", SMOL[:2] + TINY, ids=[f"{r}x{c}" for r, c in SMOL[:2] + TINY])
def test_the_decode_plan_is_minimal_among_every_split(shape):
    plan = decode_plan(*shape, SLOTS)
    assert plan.cost(PLAN_WORKERS) == pytest.approx(min(cheapest(*shape, SLOTS, c) for c in (1, 2)))


@settings(max_examples=30, derandomize=True, deadline=None)
@given(shapes, st.integers(1, 200))
def test_choose_takes_the_cheaper_plan_for_the_tokens(shape, tokens):
    chosen = choose(*shape, 1024, tokens)
    options = plans(*shape, 1024)
    assert chosen in options
    if tokens == 1:
        assert chosen == decode_plan(*shape, 1024)
    else:
        assert chosen.groups(tokens) * chosen.cost() == min(p.groups(tokens) * p.cost() for p in options)


def test_the_model_shapes_plans_are_pinned():
    """Provider and consumer derive plans from the shapes alone: a change here is a
    wire change (an older peer would lay the slots out differently), so it goes with a
    protocol revision (protocol.md) and an update of these values."""
    got = {shape: [(p.baby, p.giant, p.tokens, p.chunks, p.outputs) for p in plans(*shape, SLOTS)] for shape in SMOL}
    assert got == {(960, 576): [(6, 12, 1, 1, 1), (16, 3, 3, 1, 5)], (576, 576): [(4, 12, 1, 1, 1), (12, 4, 3, 1, 3)],
                   (3072, 576): [(10, 6, 1, 1, 4), (24, 2, 3, 1, 16)],
                   (576, 1536): [(6, 10, 1, 1, 2), (8, 8, 3, 2, 3)]}


def test_a_request_fits_its_frame_whichever_plan_it_gets():
    for shape in SMOL + QWEN05 + LLAMA8B:  # every family's widths: 8B's down reads 14,336 columns
        most = request_tokens(*shape, SLOTS, max_tokens=64, max_inputs=128, max_outputs=96)
        assert 1 <= most <= 64
        for tokens in range(1, most + 1):
            plan = choose(*shape, SLOTS, tokens)
            assert plan.groups(tokens) * plan.outputs <= 96 and plan.groups(tokens) * plan.chunks <= 128


def test_layout_functions_check_their_shapes(monkeypatch):
    plan = choose(10, 7, SLOTS)
    with pytest.raises(ValueError):
        plan.input_slots(np.zeros((1, 8)))
    with pytest.raises(ValueError):
        plan.input_slots(np.zeros((plan.tokens + 1, 7)))
    with pytest.raises(ValueError):
        plan.diagonals(np.zeros((10, 8)), 0)
    with pytest.raises(ValueError):
        plan.reduce(np.zeros((plan.outputs + 1, SLOTS)), 1)
    with pytest.raises(ValueError):
        Plan(1, 2 * SLOTS + 1, SLOTS, 1, 1)  # one chunk's elements past the slots
    with pytest.raises(ValueError):
        Plan(0, 1, SLOTS, 1, 1)
    with pytest.raises(ValueError):
        Plan(1, 600, 1024, 1, 1, tokens=4)  # four blocks of 300 do not fit 1,024 slots
    with pytest.raises(ValueError):
        choose(10, 7, SLOTS, 0)
    monkeypatch.setattr(plan_module, "MAX_TOKENS_PER_CIPHERTEXT", 1)
    prompt_plan.cache_clear()
    try:
        assert prompt_plan(10, 7, SLOTS) is None and plans(10, 7, SLOTS) == (decode_plan(10, 7, SLOTS),)
    finally:
        prompt_plan.cache_clear()


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_shares_partition_every_products_pairs_evenly(workers):
    """he/matvec.share_pairs: each (output, giant step) pair to exactly one worker,
    whole outputs where every worker can have one (nothing to add up), shares within
    one output's giant steps of each other."""
    from compushare.he.matvec import share_pairs  # noqa: PLC0415

    for shape in SMOL + QWEN05 + TINY:
        for plan in plans(*shape, SLOTS):
            shares = [share_pairs(plan, i, workers) for i in range(workers)]
            pairs = sorted(p for share in shares for p in share)
            assert pairs == [(o, g) for o in range(plan.outputs) for g in range(plan.giant)]
            sizes = [len(share) for share in shares]
            assert max(sizes) - min(sizes) <= plan.giant
            split = [o for o in range(plan.outputs) if sum(any(q == o for q, _ in s) for s in shares) > 1]
            assert len(split) <= plan.outputs % workers
