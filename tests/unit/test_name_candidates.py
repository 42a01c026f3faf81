"""pipeline/client/names.py: which model ids the swarm serves under a name, counting
only providers the view holds evidence for, so a Sybil flood cannot decide it."""

from __future__ import annotations

import pytest

from compushare.errors import ModelUnavailable
from compushare.hardware import Hardware
from compushare.net.ads import CapabilityAd, Serving
from compushare.net.view import SwarmView
from compushare.pipeline.client.names import choose_candidate, name_candidates

NOW = 1_700_000_000.0
HW = Hardware(cpu_cores=2, ram_mb=24000, ram_free_mb=20000, gpu=None, gpu_mb=0)
REAL, FAKE, OTHER = "aa" * 32, "ff" * 32, "bb" * 32


def ad(peer: str, model_id: str, span: tuple[int, int], name: str = "tinyllama", fmt: str = "q4/g64"):
    serving = Serving(model_id, *span, "float32", free_tokens=8192, load=0.0, block_rate=40.0, fmt=fmt, name=name)
    return CapabilityAd(peer, (), HW, (serving,), "0.1.0", seq=int(NOW * 1e3), sent=NOW, expires=NOW + 60)


def honest(i: int) -> str:
    return f"12D3KooWhonest{i:04d}"


def sybil(i: int) -> str:
    return f"12D3KooWsybil{i:05d}"


def test_a_sybil_flood_does_not_decide_what_a_name_means():
    view = SwarmView(policy=True)
    for i, span in enumerate([(0, 11), (11, 22)]):
        view.offer(ad(honest(i), REAL, span), NOW)
    for i in range(200):  # many more providers, all fresh keys
        view.offer(ad(sybil(i), FAKE, (0, 22), fmt="int8"), NOW)
    view.offer(ad(honest(9), OTHER, (0, 22), name="something-else"), NOW)
    view.note_connected([honest(0), honest(1)], NOW)
    candidates = name_candidates(view, "tinyllama", NOW)
    assert [(c.model_id, c.evidenced, c.blocks) for c in candidates] == [(REAL, 2, 22), (FAKE, 0, 0)]
    assert candidates[1].providers == 200 and candidates[1].fmt == "int8"
    assert choose_candidate("tinyllama", candidates).model_id == REAL
    # Karma evidence counts as much as a connection.
    view.note_connected([], NOW)
    view.note_karma([honest(1)], NOW)
    assert name_candidates(view, "tinyllama", NOW)[0].model_id == REAL


def test_without_evidence_the_user_chooses_by_id():
    view = SwarmView(policy=True)
    for i in range(3):
        view.offer(ad(sybil(i), FAKE, (0, 22)), NOW)
    candidates = name_candidates(view, "tinyllama", NOW)
    with pytest.raises(ModelUnavailable, match="none from a provider with evidence.*--model <id>"):
        choose_candidate("tinyllama", candidates)
    with pytest.raises(ModelUnavailable, match="no server in the swarm serves"):
        choose_candidate("nothing", name_candidates(view, "nothing", NOW))
    # With the view policy off (a defence disabled), every provider counts.
    open_view = SwarmView(policy=False)
    open_view.offer(ad(sybil(0), FAKE, (0, 22)), NOW)
    assert choose_candidate("tinyllama", name_candidates(open_view, "tinyllama", NOW)).model_id == FAKE


def test_ties_break_by_blocks_then_providers_then_id():
    view = SwarmView(policy=True)
    view.offer(ad(honest(0), OTHER, (0, 5)), NOW)
    view.offer(ad(honest(1), REAL, (0, 22)), NOW)
    view.note_connected([honest(0), honest(1)], NOW)
    assert [c.model_id for c in name_candidates(view, "tinyllama", NOW)] == [REAL, OTHER]


def test_a_few_evidenced_providers_of_a_fragment_do_not_outrank_a_whole_model():
    """Three providers with evidence serving one block of a fake id lose to two serving
    the whole of the real one: a model is useful only whole."""
    view = SwarmView(policy=True)
    view.offer(ad(honest(0), REAL, (0, 11)), NOW)
    view.offer(ad(honest(1), REAL, (11, 22)), NOW)
    for i in range(3):
        view.offer(ad(sybil(i), FAKE, (0, 1)), NOW)
    view.note_connected([honest(0), honest(1)] + [sybil(i) for i in range(3)], NOW)
    assert choose_candidate("tinyllama", name_candidates(view, "tinyllama", NOW)).model_id == REAL
