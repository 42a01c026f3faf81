"""DiLoCo's data and local training: the corpus split and digest, the public-seed sampler,
the recipe's checked wire form, a round's bit-for-bit reproducibility, the outer optimizer
against torch's SGD, and the flat-weights round trip."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compushare.diloco import inner
from compushare.diloco.corpus import Corpus, eval_batches, minibatch, minibatch_seed, single_minibatch
from compushare.diloco.recipe import MAX_PARAMS, Recipe
from compushare.errors import PeerMisbehaved

pytestmark = pytest.mark.unit

DATA = bytes(range(256)) * 64  # 16 KiB, every byte value
EVAL = 1024


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.from_bytes(DATA, eval_bytes=EVAL)


def tiny(corpus_digest: str, **changes) -> Recipe:
    """A recipe small enough to train a few steps in milliseconds."""
    base = Recipe.default_small(corpus_digest)
    model = dict(base.model, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=16)
    return dataclasses.replace(base, model=model, seq_len=16, batch=2, steps=3, warmup=1, **changes)


def test_corpus_split_and_digest(corpus, tmp_path):
    assert corpus.digest == hashlib.sha256(DATA).hexdigest()
    assert len(corpus.eval) == EVAL and len(corpus.train) == len(DATA) - EVAL
    assert corpus.train.tobytes() + corpus.eval.tobytes() == DATA
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(DATA))
    (tmp_path / "c.txt").write_bytes(DATA)
    for name in ("c.txt.gz", "c.txt"):
        loaded = Corpus.load(tmp_path / name, eval_bytes=EVAL)
        assert loaded.digest == corpus.digest and loaded.eval.tobytes() == corpus.eval.tobytes()
    with pytest.raises(ValueError):
        Corpus.from_bytes(b"x" * 100, eval_bytes=EVAL)


def test_minibatch_is_determined_by_every_seed_input(corpus):
    recipe = tiny(corpus.digest)
    base = dict(run_id="run", peer="p", round=1, step=2)
    first = minibatch(corpus, recipe, **base)
    assert first.shape == (recipe.batch, recipe.seq_len + 1) and first.dtype == torch.int64
    assert torch.equal(first, minibatch(corpus, recipe, **base))
    for key, other in (("run_id", "run2"), ("peer", "q"), ("round", 2), ("step", 3)):
        assert not torch.equal(first, minibatch(corpus, recipe, **{**base, key: other})), key
    reseeded = dataclasses.replace(recipe, seed=1)
    assert not torch.equal(first, minibatch(corpus, reseeded, **base))
    # Windows are runs of consecutive training bytes (DATA counts up mod 256).
    assert ((first[:, 1:] - first[:, :-1]) % 256 == 1).all()
    # Length-prefixed strings: moving a character between run id and peer changes the seed.
    assert minibatch_seed(0, "ab", "c", 0, 0) != minibatch_seed(0, "a", "bc", 0, 0)
    single = single_minibatch(corpus, recipe, global_batch=5, step=0)
    assert single.shape == (5, recipe.seq_len + 1)


def test_eval_batches_are_fixed_consecutive_windows(corpus):
    recipe = tiny(corpus.digest)
    batches = eval_batches(corpus, recipe, 3)
    width = recipe.seq_len + 1
    flat = torch.cat([b.reshape(-1) for b in batches])
    assert flat.tolist() == list(corpus.eval[:3 * recipe.batch * width])
    with pytest.raises(ValueError):
        eval_batches(corpus, recipe, EVAL)


def test_recipe_wire_round_trip():
    recipe = Recipe.default_small("ab" * 32)
    wire = msgpack.unpackb(msgpack.packb(recipe.to_wire()))
    assert Recipe.from_wire(wire) == recipe
    assert inner.param_count(recipe) == recipe.param_count == 820_352


def test_too_large_or_malformed_models_are_refused():
    wire = Recipe.default_small("ab" * 32).to_wire()
    huge = dict(wire["model"], hidden_size=4096, num_hidden_layers=64, intermediate_size=16384)
    with pytest.raises(PeerMisbehaved, match="exceeds the limit"):
        Recipe.from_wire({**wire, "model": huge})
    assert Recipe(**{**Recipe.from_wire(wire).__dict__, "model": huge}).param_count > MAX_PARAMS
    for bad in ({"hidden_size": 130}, {"num_key_value_heads": 3}, {"vocab_size": 512}, {"rope_theta": math.nan},
                {"tie_word_embeddings": 1}, {"extra": 1}):
        with pytest.raises(PeerMisbehaved):
            Recipe.from_wire({**wire, "model": {**wire["model"], **bad}})
    for bad in ({"lr": math.inf}, {"lr": 1}, {"batch": True}, {"warmup": 51}, {"corpus": "AB" * 32},
                {"tokenizer": "bpe"}, {"betas": [0.9]}, {"seq_len": 129}, {"nesterov": 0}):
        with pytest.raises(PeerMisbehaved):
            Recipe.from_wire({**wire, **bad})


junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
                    lambda inner_: st.lists(inner_, max_size=3) | st.dictionaries(st.text(max_size=8), inner_, max_size=3),
                    max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(Recipe.default_small("ab" * 32).to_wire())), value=junk,
       model_key=st.sampled_from(sorted(Recipe.default_small("ab" * 32).model)), whole=junk)
def test_from_wire_refuses_junk_with_peer_misbehaved_only(key, value, model_key, whole):
    wire = Recipe.default_small("ab" * 32).to_wire()
    for candidate in ({**wire, key: value}, {**wire, "model": {**wire["model"], model_key: value}}, whole):
        try:
            Recipe.from_wire(candidate)
        except PeerMisbehaved:
            pass


def test_flat_params_round_trip(corpus):
    recipe = tiny(corpus.digest)
    model = inner.build_model(recipe)
    flat = inner.flat_params(model)
    assert flat.dtype == torch.float32 and flat.numel() == inner.param_count(recipe)
    assert torch.equal(flat, inner.flat_params(inner.build_model(recipe)))  # init depends on the seed alone
    changed = torch.arange(flat.numel(), dtype=torch.float32)
    inner.load_flat(model, changed)
    assert torch.equal(inner.flat_params(model), changed)
    with pytest.raises(ValueError):
        inner.load_flat(model, changed[:-1])


def test_a_round_is_reproducible_bit_for_bit(corpus):
    recipe = tiny(corpus.digest)
    weights = inner.flat_params(inner.build_model(recipe))
    args = dict(run_id="run", peer="p", round=4)
    first = inner.train_round(recipe, corpus, weights, **args)
    model = inner.build_model(dataclasses.replace(recipe, seed=9))  # reused module: its own weights don't matter
    inner.train_round(recipe, corpus, weights, run_id="run", peer="q", round=4, model=model)
    second = inner.train_round(recipe, corpus, weights, **args, model=model)
    assert first.pseudo_grad.numpy().tobytes() == second.pseudo_grad.numpy().tobytes()
    assert first.loss == second.loss and first.tokens == 3 * 2 * 16
    assert first.pseudo_grad.abs().sum() > 0
    other = inner.train_round(recipe, corpus, weights, run_id="run", peer="p", round=5, model=model)
    assert not torch.equal(first.pseudo_grad, other.pseudo_grad)
    assert math.isfinite(inner.eval_loss(recipe, corpus, weights, batches=2))


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_optimizer_matches_torch_sgd(nesterov):
    recipe = dataclasses.replace(Recipe.default_small("ab" * 32), nesterov=nesterov)
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(1000, generator=gen)
    param = torch.nn.Parameter(weights.clone())
    reference = torch.optim.SGD([param], lr=recipe.outer_lr, momentum=recipe.outer_momentum, nesterov=nesterov)
    ours = inner.OuterOptimizer(recipe, weights.numel())
    for _ in range(4):
        grad = torch.randn(1000, generator=gen)
        param.grad = grad.clone()
        reference.step()
        weights = ours.step(weights, grad)
        assert torch.equal(weights, param.detach())
    joiner = inner.OuterOptimizer(recipe, weights.numel())
    joiner.load_state(ours.state())
    grad = torch.randn(1000, generator=gen)
    assert torch.equal(joiner.step(weights, grad), ours.step(weights, grad))
    with pytest.raises(ValueError):
        joiner.load_state(torch.full((1000,), math.nan))


def test_train_single_runs_and_returns_flat_weights(corpus):
    recipe = tiny(corpus.digest)
    seen = []
    weights, tail = inner.train_single(recipe, corpus, global_batch=3, steps=2, on_step=lambda s, loss: seen.append(s))
    assert seen == [0, 1] and weights.numel() == inner.param_count(recipe) and math.isfinite(tail)
