"""pipeline/client/speculative.py: prompt-lookup drafts, greedy acceptance, and
speculative sampling's output distribution, checked with a chi-square test on the
tiny model's next-token distribution (and shown to reject a sampler that keeps its
drafts)."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from compushare.model.blocks import load_full_model
from compushare.pipeline.client.sampling import Sampler, SamplingParams
from compushare.pipeline.client.speculative import (
    MAX_NGRAM, DraftLength, NgramDrafter, accept_greedy, accept_sampled,
)

DRAWS = 6000


def brute_force_draft(context: list[int], k: int) -> list[int]:
    for n in range(min(MAX_NGRAM, len(context)), 0, -1):
        tail = context[-n:]
        for end in range(len(context) - 1, n - 1, -1):  # latest earlier occurrence first
            if context[end - n:end] == tail:
                return context[end:end + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=40), st.integers(0, 6), st.integers(0, 40))
def test_drafts_are_what_followed_the_latest_earlier_occurrence(context, k, cut):
    drafter = NgramDrafter(context[:len(context) // 2])
    drafter.extend(context[len(context) // 2:])  # grown in two parts, as generation does
    assert drafter.draft(k) == (brute_force_draft(context, k) if k else [])
    drafter.truncate(cut)
    assert drafter.draft(k) == (brute_force_draft(context[:cut], k) if k else [])


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 4, 7, 9]):
        logits[row, best] = 1.0
    assert accept_greedy(logits, [3, 4, 5]) == ([3, 4, 7], 2)
    assert accept_greedy(logits, [3, 4, 7]) == ([3, 4, 7, 9], 3)  # all kept, plus the model's next
    assert accept_greedy(logits, [0, 4, 7]) == ([3], 0)
    assert accept_greedy(logits[:1], []) == ([3], 0)


def model_distribution(tiny_model) -> torch.Tensor:
    """The tiny model's next-token distribution after a short context, at temperature 1.5
    with top-p 0.95 (so many tokens are likely, and top-p has cut some)."""
    model = load_full_model(tiny_model)
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 17, 42, 99, 3]])).logits[0, -1]
    return Sampler(SamplingParams(temperature=1.5, top_p=0.95)).distribution(logits.unsqueeze(0))[0]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square test's p-value of `counts` drawn from `probs` (bins of expected
    count under 5 pooled into one)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def first_tokens(sampler, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for _ in range(DRAWS):
        counts[sampler()] += 1
    return counts


def test_speculative_sampling_keeps_the_models_distribution(tiny_model):
    p = model_distribution(tiny_model)
    vocab = p.shape[0]
    generator = torch.Generator().manual_seed(7)
    # A draft model q far from p: half its mass on one token p finds unlikely.
    unlikely = int(torch.argsort(p)[vocab // 2])
    q = 0.5 * p.clone()
    q[unlikely] += 0.5
    assert 0.5 * float((p - q).abs().sum()) >= 0.3  # total-variation distance
    rows = torch.stack([p, p])  # after the draft the model's next distribution (unused past the first token)

    def speculative() -> int:
        draft = int(torch.multinomial(q, 1, generator=generator))
        emitted, _ = accept_sampled(rows, [draft], generator, draft_probs=q.unsqueeze(0))
        return emitted[0]

    def point_mass_draft() -> int:  # an n-gram draft: the unlikely token, with certainty
        emitted, _ = accept_sampled(rows, [unlikely], generator)
        return emitted[0]

    def keeps_its_drafts() -> int:  # wrong: every draft kept, so tokens follow q
        return int(torch.multinomial(q, 1, generator=generator))

    assert chi_square_p(first_tokens(speculative, vocab), p) > 1e-3
    assert chi_square_p(first_tokens(point_mass_draft, vocab), p) > 1e-3
    assert chi_square_p(first_tokens(keeps_its_drafts, vocab), p) < 1e-6  # the test has the power


def test_all_drafts_kept_then_one_more_from_the_model():
    p = torch.zeros(3, 5)
    p[0, 1] = p[1, 2] = p[2, 4] = 1.0  # the model is certain: drafts 1, 2 are kept, 4 follows
    assert accept_sampled(p, [1, 2], torch.Generator().manual_seed(0)) == ([1, 2, 4], 2)
    assert accept_sampled(p, [1, 3], torch.Generator().manual_seed(0)) == ([1, 2], 1)  # 3 has p = 0


def test_draft_length_follows_acceptance_and_cost():
    sizer = DraftLength()
    for _ in range(5):
        sizer.observe(0, 0, 0.10)  # a one-token pass: 100 ms
    for _ in range(10):
        sizer.observe(4, 4, 0.11)  # 4 drafts cost 10 ms more, all kept
    assert sizer.choose(8) >= 4
    for _ in range(20):
        sizer.observe(4, 0, 0.11)  # nothing kept: drafting does not pay
    assert sizer.choose(8) == 0
    assert sizer.choose(0) == 0
    probes = [sizer.choose(8) for _ in range(sizer.probe_every)]
    assert probes.count(2) == 1 and set(probes) == {0, 2}  # it looks again now and then
