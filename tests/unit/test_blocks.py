"""model/blocks.py + model/head.py: spans of decoder layers reproduce the full model exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from compushare.model.arch import load_config
from compushare.model.blocks import SpanRunner, read_tensors, span_tensor_names
from compushare.model.head import HEAD_TENSORS, ConsumerHead
from helpers import reference_model

PROMPT = [1, 17, 42, 99, 3]
CHUNKS = [(0, 3), (3, 5)]  # a chunked prefill: 3 tokens, then 2
DECODE_STEPS = 10


@pytest.fixture(scope="module")
def full(tiny_model):
    return reference_model(tiny_model, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def head(tiny_model):
    return ConsumerHead.load(tiny_model)


@pytest.fixture(scope="module")
def stages(tiny_model):
    return SpanRunner.load(tiny_model, 0, 2), SpanRunner.load(tiny_model, 2, 4)


@pytest.fixture(scope="module")
def whole(tiny_model):
    return SpanRunner.load(tiny_model, 0, 4)


class Reference:
    """The full transformers model, fed the same chunks with its own KV cache."""

    def __init__(self, model):
        self.model = model
        self.cache = DynamicCache(config=model.config)

    @torch.inference_mode()
    def step(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # logits_to_keep=1, as generate() does: the last position's logits only. (Computing all
        # positions' logits uses a larger matmul, which differs from it in the last ulp.)
        out = self.model(torch.tensor([ids]), past_key_values=self.cache, use_cache=True, output_hidden_states=True,
                         logits_to_keep=1)
        return out.logits[0, -1].float(), out.hidden_states


class Split:
    """Head + stages, each stage with its own cache, like separate servers."""

    def __init__(self, head, runners):
        self.head, self.runners = head, runners
        self.caches = [r.new_cache() for r in runners]
        self.length = 0

    def hidden(self, ids: list[int]) -> list[torch.Tensor]:
        hidden = self.head.embed_tokens(ids)
        outs = []
        for runner, cache in zip(self.runners, self.caches):
            hidden = runner.forward(hidden, cache, self.length)
            outs.append(hidden)
        self.length += len(ids)
        return outs

    def step(self, ids: list[int]) -> torch.Tensor:
        return self.head.logits(self.hidden(ids)[-1])


def run_generation(reference, split):
    """Chunked prefill, then greedy decode; returns both logit sequences and the tokens."""
    ref_logits, split_logits = [], []
    for a, b in CHUNKS:
        ref_logits.append(reference.step(PROMPT[a:b])[0])
        split_logits.append(split.step(PROMPT[a:b]))
    tokens = []
    for _ in range(DECODE_STEPS):
        token = int(torch.argmax(ref_logits[-1]))
        tokens.append(token)
        ref_logits.append(reference.step([token])[0])
        split_logits.append(split.step([token]))
    return ref_logits, split_logits, tokens


def test_two_stage_split_reproduces_the_full_model_exactly(full, head, stages):
    ref_logits, split_logits, tokens = run_generation(Reference(full), Split(head, list(stages)))
    assert len(ref_logits) == len(split_logits) == len(CHUNKS) + DECODE_STEPS
    for i, (ref, got) in enumerate(zip(ref_logits, split_logits)):
        assert got.dtype == torch.float32 and got.shape == (256,)
        assert torch.equal(got, ref), f"step {i}: max diff {(got - ref).abs().max().item()}"
    assert len(set(tokens)) > 1  # the random model does not just repeat one token


def test_intermediate_hidden_states_match_the_full_model(full, head, stages):
    reference, split = Reference(full), Split(head, list(stages))
    for a, b in CHUNKS:
        _, hidden_states = reference.step(PROMPT[a:b])
        first, _ = split.hidden(PROMPT[a:b])
        assert torch.equal(first, hidden_states[2])  # output of layer 1 == input of layer 2


def test_chunked_prefill_agrees_with_a_single_prefill(full, head, stages):
    one_shot = Split(head, list(stages)).step(PROMPT)
    chunked = Split(head, list(stages))
    for a, b in CHUNKS:
        logits = chunked.step(PROMPT[a:b])
    torch.testing.assert_close(logits, one_shot, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        full_logits = full(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(one_shot, full_logits, rtol=1e-5, atol=1e-5)


def test_the_split_is_causal(head, stages):
    """A later token must not change earlier positions' outputs (a non-causal prefill would)."""
    a = Split(head, list(stages)).hidden(PROMPT)[-1]
    b = Split(head, list(stages)).hidden(PROMPT[:3] + [200, 201])[-1]
    torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 3:], b[:, 3:])


def test_stages_keep_global_layer_indices(stages):
    first, second = stages
    assert sorted(first.layers) == [0, 1] and sorted(second.layers) == [2, 3]
    assert [layer.self_attn.layer_idx for layer in second.layers.values()] == [2, 3]
    cache = second.new_cache()
    second.forward(torch.randn(1, 3, 64), cache, 0)
    assert second.cached_length(cache) == 3
    assert cache.get_seq_length(2) == cache.get_seq_length(3) == 3
    assert cache.get_seq_length(0) == 0  # layers of the other stage are untouched


def test_truncate_rolls_back_so_recomputing_gives_identical_outputs(head, stages):
    first, second = stages
    caches = [first.new_cache(), second.new_cache()]

    def run(ids, position):
        hidden = head.embed_tokens(ids)
        for runner, cache in zip(stages, caches):
            hidden = runner.forward(hidden, cache, position)
        return hidden

    run(PROMPT, 0)
    accepted = run([50, 51], 5)
    assert first.cached_length(caches[0]) == second.cached_length(caches[1]) == 7
    speculative = run([60, 61, 62], 7)
    for runner, cache in zip(stages, caches):
        runner.truncate(cache, 7)
        assert runner.cached_length(cache) == 7
    again = run([60, 61, 62], 7)
    assert torch.equal(again, speculative)
    # Roll back further, into what was accepted, and recompute differently then identically.
    for runner, cache in zip(stages, caches):
        runner.truncate(cache, 5)
        assert runner.cached_length(cache) == 5
    assert torch.equal(run([50, 51], 5), accepted)
    # Truncating to the current length, or beyond it, changes nothing.
    for runner, cache in zip(stages, caches):
        runner.truncate(cache, 7)
        runner.truncate(cache, 100)
        assert runner.cached_length(cache) == 7


def test_truncate_then_different_tokens_equals_a_fresh_run(head, stages):
    fresh = Split(head, list(stages))
    fresh.step(PROMPT)
    expected = fresh.step([9, 8])

    split = Split(head, list(stages))
    split.step(PROMPT)
    split.step([70, 71, 72])
    for runner, cache in zip(split.runners, split.caches):
        runner.truncate(cache, 5)
    split.length = 5
    assert torch.equal(split.step([9, 8]), expected)


def test_parameter_count_matches_the_full_model(full, stages, whole):
    def layer_params(indices):
        return sum(p.numel() for i in indices for p in full.model.layers[i].parameters())

    first, second = stages
    assert first.parameter_count() == layer_params([0, 1])
    assert second.parameter_count() == layer_params([2, 3])
    assert whole.parameter_count() == layer_params(range(4)) == first.parameter_count() + second.parameter_count()
    assert whole.parameter_count() < sum(p.numel() for p in full.parameters())  # no embeddings or head


def test_loaded_weights_are_the_stored_ones(full, stages):
    _, second = stages
    ours = dict(second.layers[3].named_parameters())
    theirs = dict(full.model.layers[3].named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_sub_span_forward(whole, stages):
    torch.manual_seed(0)
    hidden = torch.randn(1, 4, 64)
    # Whole span in one call.
    full_cache = whole.new_cache()
    expected = whole.forward(hidden, full_cache, 0)
    # Same runner, two sub-span calls sharing a cache.
    cache = whole.new_cache()
    middle = whole.forward(hidden, cache, 0, 0, 2)
    assert torch.equal(whole.forward(middle, cache, 0, 2, 4), expected)
    # A sub-span equals the dedicated stage for it.
    first, second = stages
    assert torch.equal(whole.forward(hidden, whole.new_cache(), 0, 0, 2), first.forward(hidden, first.new_cache(), 0))
    assert torch.equal(whole.forward(middle, whole.new_cache(), 0, 2, 4),
                       second.forward(middle, second.new_cache(), 0))
    assert torch.equal(whole.forward(middle, whole.new_cache(), 0, start=2),
                       second.forward(middle, second.new_cache(), 0))


def test_sub_span_decode_matches_the_dedicated_stage(whole, stages):
    """A server holding 0:4 serving a session for 2:4 (a suffix hop)."""
    _, second = stages
    torch.manual_seed(1)
    steps = [torch.randn(1, 3, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)]
    sub_cache, own_cache = whole.new_cache(), second.new_cache()
    position = 0
    for hidden in steps:
        got = whole.forward(hidden, sub_cache, position, 2, 4)
        assert torch.equal(got, second.forward(hidden, own_cache, position))
        position += hidden.shape[1]


def test_truncate_rolls_back_a_sub_span_session(whole, stages):
    _, second = stages
    torch.manual_seed(2)
    prompt, spec = torch.randn(1, 3, 64), torch.randn(1, 2, 64)
    cache = whole.new_cache()
    whole.forward(prompt, cache, 0, 2, 4)
    whole.forward(spec, cache, 3, 2, 4)
    whole.truncate(cache, 3)
    assert cache.get_seq_length(2) == 3
    own = second.new_cache()
    second.forward(prompt, own, 0)
    assert torch.equal(whole.forward(spec, cache, 3, 2, 4), second.forward(spec, own, 3))


@pytest.mark.parametrize(("start", "end"), [(0, 5), (-1, 2), (2, 2), (3, 1)])
def test_bad_spans_are_refused(tiny_model, start, end):
    config = load_config(tiny_model)
    with pytest.raises(ValueError):
        SpanRunner(config, start, end, {})


@pytest.mark.parametrize(("start", "end"), [(0, 2), (1, 4), (3, 3), (2, 1), (-1, 3)])
def test_bad_sub_spans_are_refused(stages, start, end):
    _, second = stages  # serves 2:4
    with pytest.raises(ValueError):
        second.forward(torch.zeros(1, 1, 64), second.new_cache(), 0, start, end)


def test_missing_layer_weights_are_refused(tiny_model):
    config = load_config(tiny_model)
    state = read_tensors(tiny_model, lambda names: span_tensor_names(names, 0, 1))
    with pytest.raises(RuntimeError):
        SpanRunner(config, 0, 2, state)  # layer 1 has no weights
    state.pop("model.layers.0.mlp.up_proj.weight")
    with pytest.raises(RuntimeError):
        SpanRunner(config, 0, 1, state)


def test_span_tensor_names():
    names = ["model.embed_tokens.weight", "model.layers.1.a", "model.layers.10.b", "model.layers.2.c",
             "model.layers.11.d", "lm_head.weight", "model.norm.weight"]
    assert span_tensor_names(names, 1, 11) == ["model.layers.1.a", "model.layers.10.b", "model.layers.2.c"]
    assert span_tensor_names(names, 0, 1) == []


def test_a_span_reads_only_its_own_tensors(tiny_model):
    state = read_tensors(tiny_model, lambda names: span_tensor_names(names, 2, 3))
    assert state and all(name.startswith("model.layers.2.") for name in state)
    head_state = read_tensors(tiny_model, lambda names: [n for n in names if n in HEAD_TENSORS])
    assert set(head_state) == set(HEAD_TENSORS)


def test_head_matches_the_full_model(full, head):
    ids = [1, 5, 9]
    with torch.inference_mode():
        expected = full.model.embed_tokens(torch.tensor([ids]))
    assert torch.equal(head.embed_tokens(ids), expected)
    hidden = torch.randn(1, 3, 64)
    with torch.inference_mode():
        logits = full.lm_head(full.model.norm(hidden)[:, -1:])[0, -1]
    assert torch.equal(head.logits(hidden), logits)  # the last position only
    assert head.logits(hidden).shape == (256,)


def test_tied_head_reuses_the_embedding(tmp_path):
    from helpers import make_tiny_llama

    tied = make_tiny_llama(tmp_path / "tied", tie=True, layers=1)
    head = ConsumerHead.load(tied)
    assert torch.equal(head.lm_head, head.embed)
    model = reference_model(tied)
    hidden = torch.randn(1, 2, 64)
    with torch.inference_mode():
        expected = model.lm_head(model.model.norm(hidden)[:, -1:])[0, -1]
    assert torch.equal(head.logits(hidden), expected)


def test_head_reads_the_norm_epsilon_from_the_config(tmp_path):
    import json

    from helpers import make_tiny_llama

    path = make_tiny_llama(tmp_path / "eps", layers=1)
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 0.5  # far from the default: a head ignoring it gives other logits
    (path / "config.json").write_text(json.dumps(config))
    model = reference_model(path)
    hidden = torch.randn(1, 2, 64)
    with torch.inference_mode():
        expected = model.lm_head(model.model.norm(hidden)[:, -1:])[0, -1]
    assert torch.equal(ConsumerHead.load(path).logits(hidden), expected)


def test_head_refuses_an_unsupported_architecture(tmp_path):
    import json

    from compushare.errors import ModelUnavailable
    from helpers import make_tiny_llama

    path = make_tiny_llama(tmp_path / "other", layers=1)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["FalconForCausalLM"], model_type="falcon")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelUnavailable, match="unsupported architecture FalconForCausalLM: CompuShare serves "
                                               "Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral, Gemma 2"):
        ConsumerHead.load(path)


def test_bfloat16_span_runs_and_stays_close(tiny_model, stages):
    first, _ = stages
    bf16 = SpanRunner.load(tiny_model, 0, 2, dtype=torch.bfloat16)
    hidden = torch.randn(1, 3, 64)
    out = bf16.forward(hidden, bf16.new_cache(), 0)
    assert out.dtype == torch.bfloat16
    ref = first.forward(hidden, first.new_cache(), 0)
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_load_full_model_reads_the_store_layout(tiny_model, tmp_path):
    """The store's per-block files load into one transformers model equal to the source."""
    from compushare.model.blocks import load_full_model
    from compushare.model.store import ModelStore

    stored = ModelStore(tmp_path / "data").import_dir(tiny_model)
    original = reference_model(tiny_model)
    loaded = load_full_model(stored.path)
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.inference_mode():
        assert torch.equal(original(ids).logits, loaded(ids).logits)


def test_rejected_drafts_leave_no_trace_in_the_cache(head, stages):
    """Speculation: a verify pass of the last token and 3 drafts, of which 1 is kept,
    then cut back. The cache is bit-identical to one whose pass carried other
    rejected drafts, and the next step's output too: what was rejected left nothing.
    (The kept rows come from a 4-row pass; rows of a 1-row step round differently,
    as torch's kernels are not batch-invariant: docs/performance.md.)"""
    outputs, caches = [], []
    for rejected in ([62, 63], [90, 91]):
        split = Split(head, list(stages))
        split.step(PROMPT)
        split.step([60, 61] + rejected)
        for runner, cache in zip(split.runners, split.caches):
            runner.truncate(cache, 7)
        split.length = 7
        caches.append(split.caches)
        outputs.append(split.step([44]))
    assert torch.equal(outputs[0], outputs[1])
    for first, second in zip(*caches):
        for a, b in zip(first.layers, second.layers):
            if a.keys is not None and a.keys.numel():
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
