"""pipeline/placement.py: newcomers take the weakest window; servers move only to
fill holes or clearly lift the weakest block."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from compushare.config import Span
from compushare.hardware import Hardware
from compushare.net.ads import CapabilityAd, Serving
from compushare.pipeline.server.placement import better_span, block_strength, choose_span, span_length

MODEL = "ab" * 32
HW = Hardware(cpu_cores=2, ram_mb=1000, ram_free_mb=500, gpu=None, gpu_mb=0)


def server(peer: str, start: int, end: int, rate: float = 10.0) -> tuple[CapabilityAd, Serving]:
    serving = Serving(MODEL, start, end, "float32", 100, 0.0, rate)
    return CapabilityAd(peer, (), HW, (serving,), "0", 1, 0.0, 60.0), serving


def test_strength_sums_rates_and_counts_unknown_rates():
    servers = [server("a", 0, 4, 10), server("b", 2, 6, 0), server("c", 5, 9, 3)]
    assert block_strength(servers, 6, unknown_rate=1) == [10, 10, 11, 11, 1, 4]
    assert block_strength(servers, 6, exclude="a", unknown_rate=1) == [0, 0, 1, 1, 1, 4]


def test_span_length_is_bounded_by_the_model():
    assert span_length(30, 10) == 10 and span_length(4, 10) == 4 and span_length(30, 0) == 1


def test_newcomer_takes_the_hole():
    strength = [10.0] * 10 + [0.0] * 10 + [10.0] * 10
    assert choose_span(strength, 10, random.Random(0)) == Span(10, 20)


def test_newcomer_prefers_the_weaker_window_among_partial_overlaps():
    strength = [5.0] * 10 + [1.0] * 5 + [5.0] * 15
    span = choose_span(strength, 10, random.Random(0))
    assert span.start <= 10 and span.end >= 15


def test_empty_swarm_spreads_newcomers_at_random():
    starts = {choose_span([0.0] * 30, 10, random.Random(seed)).start for seed in range(50)}
    assert len(starts) > 5 and all(0 <= s <= 20 for s in starts)


def test_a_redundant_server_moves_into_a_hole():
    # Two servers on 0:10, one on 10:20, nobody on 20:30: one of the doubles should move.
    others = block_strength([server("b", 0, 10), server("c", 10, 20)], 30)
    assert better_span(others, Span(0, 10), 10.0, random.Random(0)) == Span(20, 30)


def test_the_only_server_of_its_blocks_stays_even_with_a_hole_elsewhere():
    others = block_strength([server("c", 10, 20)], 30)
    assert better_span(others, Span(0, 10), 10.0, random.Random(0)) is None


def test_no_flapping_over_small_differences():
    others = block_strength([server("b", 0, 10, 10), server("c", 10, 20, 9.5), server("d", 10, 20, 1)], 20)
    # Staying: 0:10 = 20, 10:20 = 10.5; moving to 10:20 leaves 0:10 at 10 -> min 10 < 10.5 * 1.2.
    assert better_span(others, Span(0, 10), 10.0, random.Random(0)) is None


def test_a_clear_gain_moves_the_server():
    others = block_strength([server("b", 0, 10, 10), server("c", 0, 10, 10), server("d", 10, 20, 2)], 20)
    assert better_span(others, Span(0, 10), 10.0, random.Random(0)) == Span(10, 20)


def test_serving_more_blocks_than_the_model_has_is_impossible():
    assert choose_span([0.0] * 4, 4, random.Random(1)) == Span(0, 4)


@given(st.lists(st.floats(0, 100), min_size=1, max_size=40), st.integers(1, 40), st.randoms(use_true_random=False))
def test_choice_is_a_weakest_window(strength, length, rng):
    length = min(length, len(strength))
    span = choose_span(strength, length, rng)
    assert len(span) == length and 0 <= span.start and span.end <= len(strength)
    chosen = min(strength[span.start:span.end])
    assert all(chosen <= min(strength[s:s + length]) + 1e-9 for s in range(len(strength) - length + 1))


@given(st.lists(st.tuples(st.integers(0, 29), st.integers(1, 10)), max_size=8), st.integers(0, 20),
       st.randoms(use_true_random=False))
def test_moving_never_opens_more_holes(spans, my_start, rng):
    others = block_strength([server(f"p{i}", s, min(s + n, 30)) for i, (s, n) in enumerate(spans)], 30)
    current = Span(my_start, my_start + 10)
    target = better_span(others, current, 10.0, rng)

    def holes(span):
        return sum(1 for b, s in enumerate(others) if s <= 0 and not span.start <= b < span.end)

    if target is not None:
        assert holes(target) <= holes(current)
        assert target != current and len(target) == len(current)
