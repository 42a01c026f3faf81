"""pipeline/sampling.py: greedy, temperature and top-p, with a seeded generator."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from compushare.pipeline.client.sampling import Sampler, SamplingParams


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> Counter:
    sampler = Sampler(params)
    return Counter(sampler.choose(logits) for _ in range(n))


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.01}, {"top_p": -1}, {"max_new_tokens": 0}],
)
def test_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_default_params_are_greedy():
    params = SamplingParams()
    assert params.temperature == 0.0 and params.top_p == 1.0 and params.stop_at_eos


def test_greedy_is_argmax_and_ignores_seed_and_top_p():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    for params in (SamplingParams(), SamplingParams(seed=1, top_p=0.1), SamplingParams(seed=2)):
        sampler = Sampler(params)
        assert [sampler.choose(logits) for _ in range(5)] == [1] * 5
    assert Sampler(SamplingParams()).choose(torch.tensor([0.0, 5.0, 5.0])) == 1  # first of equal maxima


def test_choose_returns_a_python_int():
    assert type(Sampler(SamplingParams()).choose(torch.tensor([1.0, 2.0]))) is int
    assert type(Sampler(SamplingParams(temperature=1.0, seed=0)).choose(torch.tensor([1.0, 2.0]))) is int
    assert type(Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0)).choose(torch.tensor([1.0, 2.0]))) is int


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_same_seed_same_tokens_different_seed_different_tokens(top_p):
    logits = torch.zeros(256)
    def run(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=seed))
        return [sampler.choose(logits) for _ in range(40)]
    assert run(7) == run(7)
    assert run(7) != run(8)
    assert len(set(run(7))) > 20  # it really samples


def test_seeded_sampler_ignores_the_global_rng():
    logits = torch.zeros(256)
    torch.manual_seed(1)
    a = [Sampler(SamplingParams(temperature=1.0, seed=3)).choose(logits) for _ in range(3)]
    torch.manual_seed(2)
    b = [Sampler(SamplingParams(temperature=1.0, seed=3)).choose(logits) for _ in range(3)]
    assert a == b


def test_temperature_sampling_follows_the_softmax():
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = draws(SamplingParams(temperature=1.0, seed=0), logits_of(probs), 4000)
    for token, p in enumerate(probs):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_temperature_scales_logits():
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    hot = draws(SamplingParams(temperature=2.0, seed=0), logits, 4000)
    expected = torch.softmax(logits / 2.0, dim=-1)
    for token in range(4):
        assert abs(hot[token] / 4000 - expected[token].item()) < 0.03
    assert hot[3] / 4000 > 0.08  # flatter than temperature 1 (0.05)
    cold = draws(SamplingParams(temperature=0.05, seed=0), logits, 300)
    assert cold == Counter({0: 300})


def test_top_p_keeps_only_the_nucleus():
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = draws(SamplingParams(temperature=1.0, top_p=0.6, seed=0), logits_of(probs), 4000)
    assert set(counts) == {0, 1}  # 0.5 < 0.6, so the 0.3 token is needed; the rest are not
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.03  # renormalised within the nucleus
    counts = draws(SamplingParams(temperature=1.0, top_p=0.85, seed=0), logits_of(probs), 4000)
    assert set(counts) == {0, 1, 2}
    counts = draws(SamplingParams(temperature=1.0, top_p=1.0, seed=0), logits_of(probs), 4000)
    assert set(counts) == {0, 1, 2, 3}


def test_tiny_top_p_always_keeps_the_top_token():
    logits = torch.tensor([1.0, 1.2, 0.9, 1.1])  # top token is index 1, not index 0
    assert draws(SamplingParams(temperature=1.0, top_p=1e-6, seed=0), logits, 100) == Counter({1: 100})


def test_top_p_works_on_unsorted_vocab():
    probs = [0.05, 0.15, 0.3, 0.5]
    counts = draws(SamplingParams(temperature=1.0, top_p=0.6, seed=5), logits_of(probs), 1000)
    assert set(counts) == {2, 3}


def test_masked_tokens_are_never_sampled():
    logits = torch.tensor([0.0, float("-inf"), 0.0, float("-inf")])
    for top_p in (1.0, 0.99):
        counts = draws(SamplingParams(temperature=1.0, top_p=top_p, seed=0), logits, 500)
        assert set(counts) == {0, 2}


def test_bfloat16_logits_are_accepted():
    logits = logits_of([0.7, 0.2, 0.1]).to(torch.bfloat16)
    counts = draws(SamplingParams(temperature=1.0, top_p=0.95, seed=0), logits, 200)
    assert set(counts) <= {0, 1, 2} and counts[0] > counts[1] > 0


def test_unseeded_sampler_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    Sampler(SamplingParams(temperature=1.0))
    assert torch.equal(torch.rand(3), expected)
