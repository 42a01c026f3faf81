"""he/plan.py, pure numpy: the packed baby-step giant-step layout computes W @ x for
any shape, its rows never share an output slot, every window stays inside the
slots (a rotation is a cyclic shift of x only there), and `choose` takes the
cheapest plan of its cost model.

Property tests are derandomized: the same examples every run.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compushare.he.plan import Plan, choose

pytestmark = pytest.mark.unit

SLOTS = 4096  # N = 8192 (ckks.PARAMETER_SETS)
# SmolLM2-135M: qkv, o, gate_up, down; the tiny test Llama: o (and q), qkv, gate_up, down.
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (64, 64), (128, 64), (256, 64), (64, 128)]

shapes = st.tuples(st.integers(1, 400), st.integers(1, 700))


def check_layout(plan: Plan) -> None:
    """The structural properties every plan must have."""
    slots, window, period = plan.slots, plan.window, plan.period
    row_slots = plan.row_slots
    assert row_slots.shape == (plan.rows, plan.windows_per_row)
    flat = row_slots.ravel()
    # No two (row, window) partial sums share an output slot.
    assert np.unique(flat).size == flat.size
    assert flat.min() >= 0 and flat.max() < plan.outputs * slots
    # A window's sum reads slots s .. s + window - 1 of its ciphertext (each giant step's
    # baby steps): all inside the slots, where a rotation of x is still a cyclic shift.
    assert np.all(row_slots % slots + window <= slots)
    # The windows of a row tile its period: offsets t, t + w, t + 2w, ... from one t < w.
    offsets = (row_slots % slots) % period
    first = offsets[:, :1]
    assert np.all(first < window)
    np.testing.assert_array_equal(offsets - first, np.broadcast_to(window * np.arange(plan.windows_per_row),
                                                                   offsets.shape))
    assert plan.period % window == 0 and plan.cols <= period <= slots
    assert 1 <= plan.rows_per_output == len(plan.bases)
    assert (plan.outputs - 1) * plan.rows_per_output < plan.rows <= plan.outputs * plan.rows_per_output
    # Galois keys are needed for exactly the baby and giant steps, none of them 0 or past the slots.
    assert plan.steps == frozenset(range(1, plan.baby)) | {g * plan.baby for g in range(1, plan.giant)}
    assert all(0 < s < slots for s in plan.steps)


def check_product(plan: Plan, seed: int) -> None:
    rng = np.random.default_rng(seed)
    weight = rng.normal(0, 0.05, (plan.rows, plan.cols))
    x = rng.normal(0, 1, plan.cols)
    x[rng.integers(plan.cols)] = rng.choice([-50.0, 50.0])  # an activation outlier
    diagonals = plan.diagonals(weight)
    assert diagonals.shape == (plan.outputs, plan.giant, plan.baby, plan.slots)
    expected = weight @ x
    got = plan.simulate(diagonals, x)
    assert got.shape == (plan.rows,)
    assert np.linalg.norm(got - expected) <= 1e-9 * max(np.linalg.norm(expected), 1e-300)


@settings(max_examples=60, derandomize=True)
@given(shapes, st.sampled_from([1024, 2048, SLOTS]), st.integers(0, 2**32 - 1))
def test_plans_of_random_shapes_compute_the_product(shape, slots, seed):
    rows, cols = shape
    if cols > slots:
        with pytest.raises(ValueError):
            choose(rows, cols, slots)
        return
    plan = choose(rows, cols, slots)
    check_layout(plan)
    check_product(plan, seed)


@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=[f"{r}x{c}" for r, c in MODEL_SHAPES])
def test_plans_of_the_model_shapes_compute_the_product(shape):
    plan = choose(*shape, SLOTS)
    check_layout(plan)
    check_product(plan, seed=shape[0] * 7919 + shape[1])


@settings(max_examples=40, derandomize=True)
@given(st.integers(1, 300), st.integers(1, 300), st.integers(1, 32), st.integers(1, 32), st.integers(0, 2**32 - 1))
def test_any_valid_plan_computes_the_product(rows, cols, baby, giant, seed):
    """Not only the chosen ones: the layout is right for every split the constructor
    accepts (what a change of the cost model could pick)."""
    try:
        plan = Plan(rows, cols, SLOTS, baby, giant)
    except ValueError:
        assert -(-cols // (baby * giant)) * baby * giant > SLOTS
        return
    check_layout(plan)
    check_product(plan, seed)


def alternatives(rows: int, cols: int, slots: int) -> list[Plan]:
    """Hand-made plans in choose's search space (window <= cols, padded period within
    the slots): no window, all baby steps, all giant steps, square-ish splits, and the
    splits choose picks for the model shapes."""
    splits = {(1, 1), (1, cols), (cols, 1), (2, 2), (4, 4), (8, 8), (8, 12), (10, 16), (12, 6), (16, 6), (16, 18),
              (24, 4)}
    for window in {cols, max(1, cols // 2), max(1, cols // 3), 16, 64, 96}:
        baby = max(1, int(round(window ** 0.5)))
        while window % baby:
            baby -= 1
        splits |= {(baby, window // baby), (window // baby, baby)}
    out = []
    for baby, giant in splits:
        window = baby * giant
        if window <= cols and -(-cols // window) * window <= slots:
            out.append(Plan(rows, cols, slots, baby, giant))
    return out


@settings(max_examples=60, derandomize=True)
@given(shapes)
def test_choose_is_no_costlier_than_hand_made_plans(shape):
    plan = choose(*shape, SLOTS)
    assert plan.window <= plan.cols
    for other in alternatives(*shape, SLOTS):
        assert plan.cost() <= other.cost(), (plan, other)


@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=[f"{r}x{c}" for r, c in MODEL_SHAPES])
def test_choose_is_minimal_among_every_split_for_the_model_shapes(shape):
    """Exhaustively, for the shapes that matter: every (baby, giant) with a window up
    to twice the columns (padding past the columns included)."""
    rows, cols = shape
    plan = choose(rows, cols, SLOTS)
    best = min(other.cost() for window in range(1, min(2 * cols, SLOTS) + 1)
               if -(-cols // window) * window <= SLOTS
               for other in (Plan(rows, cols, SLOTS, b, window // b) for b in range(1, window + 1) if window % b == 0))
    assert plan.cost() == pytest.approx(best)


def test_the_model_shapes_plans_are_pinned():
    """Provider and consumer derive the plan from the shapes alone: a change here is a
    wire change (an older peer would lay the slots out differently), so it goes with a
    protocol revision (protocol.md) and an update of these values."""
    got = {shape: (choose(*shape, SLOTS).baby, choose(*shape, SLOTS).giant, choose(*shape, SLOTS).outputs)
           for shape in MODEL_SHAPES[:4]}
    assert got == {(960, 576): (10, 16, 1), (576, 576): (8, 12, 1), (3072, 576): (16, 6, 5), (576, 1536): (16, 18, 1)}


def test_reduce_and_input_slots_check_their_shapes():
    plan = choose(10, 7, SLOTS)
    with pytest.raises(ValueError):
        plan.input_slots(np.zeros(8))
    with pytest.raises(ValueError):
        plan.diagonals(np.zeros((10, 8)))
    with pytest.raises(ValueError):
        plan.reduce(np.zeros((plan.outputs + 1, SLOTS)))
    u = plan.input_slots(np.arange(1, 8, dtype=float))
    assert u.shape == (SLOTS,)
    np.testing.assert_array_equal(u[:plan.period], np.r_[np.arange(1, 8), np.zeros(plan.period - 7)])
    np.testing.assert_array_equal(u[plan.period:2 * plan.period], u[:plan.period])  # replicated
    with pytest.raises(ValueError):
        Plan(1, SLOTS + 1, SLOTS, 1, 1)
    with pytest.raises(ValueError):
        Plan(0, 1, SLOTS, 1, 1)
