"""Stop sequences over streamed text (pipeline/client/stops.py), and the log-probabilities
a generation reports (sampling.logprobs_of)."""

import pytest
import torch
from hypothesis import given, strategies as st

from compushare.pipeline.client.sampling import logprobs_of
from compushare.pipeline.client.stops import StopText

pytestmark = pytest.mark.unit

TEXT = st.text(alphabet="ab\nU:", max_size=40)


def _expected(text: str, stops: list[str], bounds: list[int]) -> tuple[str, bool]:
    """The text up to the earliest stop in the text so far, at the first piece after
    which one is complete (the generation ends there: nothing later is produced)."""
    for end in bounds[1:]:
        cuts = [text[:end].find(s) for s in stops if s and s in text[:end]]
        if cuts:
            return text[:min(cuts)], True
    return text, False


@given(text=TEXT, stops=st.lists(st.text(alphabet="ab\nU:", min_size=1, max_size=5), max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_any_split_releases_exactly_the_text_before_the_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    matcher = StopText(tuple(stops))
    pieces = [matcher.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    pieces.append(matcher.flush())
    expected, stopped = _expected(text, stops, bounds)
    assert "".join(pieces) == matcher.released == expected
    assert matcher.stopped == stopped
    assert not any(s in piece for piece in pieces for s in stops)


def test_a_stop_split_over_tokens_is_held_then_dropped():
    matcher = StopText(("\nUser:",))
    assert matcher.feed("Hello") == "Hello"
    assert matcher.feed(" there\nUs") == " there"  # "\nUs" may begin the stop: held
    assert matcher.feed("er: hi") == "" and matcher.stopped
    assert matcher.feed("more") == "" and matcher.flush() == ""
    assert matcher.released == "Hello there"


def test_the_first_stop_completed_ends_it_even_where_a_longer_one_began_earlier():
    matcher = StopText(("U", ":U:"))
    assert matcher.feed(":::U") == ":::" and matcher.stopped  # ":U:" never completes: nothing follows


def test_held_text_that_turns_out_not_to_be_a_stop_is_released():
    matcher = StopText(("END",))
    assert matcher.feed("the E") == "the "
    assert matcher.feed("ND") == "" and matcher.stopped
    other = StopText(("END",))
    assert other.feed("the EN") == "the " and other.feed("d") == "ENd" and other.flush() == ""
    assert StopText(("x",)).flush() == "" and StopText().feed("xyz") == "xyz"


def test_logprobs_are_the_models_log_softmax_with_its_likeliest_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    first, second = logprobs_of(logits, [1, 2], top=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert first.token == 1 and first.logprob == pytest.approx(float(expected[0, 1]))
    assert [t for t, _ in first.top] == [0, 1] and first.top[0][1] == pytest.approx(float(expected[0, 0]))
    assert second.top[0][0] == 2
    assert logprobs_of(logits, [3], top=0)[0].top == ()
