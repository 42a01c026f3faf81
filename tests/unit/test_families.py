"""Every model family (model/families.py) through the span runner and the consumer's
head: fp32 spans are bit-identical to transformers' whole model, batched decode
agrees with unbatched, speculation's rollback is exact across sliding windows, and
quantized spans run. One tiny random checkpoint per family (tests/tiny_families.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import DynamicCache

from compushare.errors import ModelUnavailable, PrivateModeUnsupported, UsageError
from compushare.model.batched import decode_batch
from compushare.model.blocks import SpanRunner
from compushare.model.catalog import import_path
from compushare.model.families import FAMILIES, SLIDING, family_of, family_of_config, layer_types
from compushare.model.head import ConsumerHead
from compushare.model.kernels import Int4CpuLinear, Int8Linear
from helpers import reference_model
from tiny_families import FAMILY_NAMES, WINDOW, make_tiny_family

PROMPT = [1, 17, 42, 99, 3, 200, 7]  # longer than the sliding window
CHUNKS = [PROMPT[:3], PROMPT[3:]]  # a chunked prefill
DECODE_STEPS = 6
SPANS = [(0, 1), (1, 3), (3, 4)]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def checkpoint(request, tmp_path_factory):
    return request.param, make_tiny_family(request.param, tmp_path_factory.mktemp(request.param) / "hf")


def transformers_model(path):
    family = family_of_config(json.loads((path / "config.json").read_text()))
    return reference_model(path, attn_implementation=family.attention)


class Split:
    """The consumer's head and spans, each with its own cache, as separate servers hold them."""

    def __init__(self, path, spans=SPANS):
        self.head = ConsumerHead.load(path)
        self.runners = [SpanRunner.load(path, start, end) for start, end in spans]
        self.caches = [runner.new_cache() for runner in self.runners]
        self.length = 0

    def step(self, ids: list[int]) -> torch.Tensor:
        hidden = self.head.embed_tokens(ids)
        for runner, cache in zip(self.runners, self.caches):
            hidden = runner.forward(hidden, cache, self.length)
        self.length += len(ids)
        return self.head.logits(hidden)

    def truncate(self, length: int) -> None:
        for runner, cache in zip(self.runners, self.caches):
            runner.truncate(cache, length)
        self.length = length


def generate(step) -> tuple[list[torch.Tensor], list[int]]:
    """Chunked prefill, then greedy decode: every step's logits, and the tokens."""
    logits = [step(chunk) for chunk in CHUNKS]
    tokens = []
    for _ in range(DECODE_STEPS):
        tokens.append(int(torch.argmax(logits[-1])))
        logits.append(step(tokens[-1:]))
    return logits, tokens


def test_each_family_is_found_from_its_config(checkpoint):
    name, path = checkpoint
    config = json.loads((path / "config.json").read_text())
    assert family_of_config(config) is FAMILIES[name]
    assert family_of(None, config["model_type"]) is FAMILIES[name]  # a config without "architectures"


def test_an_unknown_architecture_is_refused_naming_the_families():
    with pytest.raises(ModelUnavailable) as refused:
        family_of(["GPT2LMHeadModel"], "gpt2")
    message = str(refused.value)
    assert "GPT2LMHeadModel" in message
    assert all(family.title in message for family in FAMILIES.values())


def test_spans_and_head_are_bit_identical_to_transformers(checkpoint, tmp_path):
    """Spans and head as a node loads them, from the imported store."""
    name, path = checkpoint
    stored = import_path(path, tmp_path / "data", alias=name).path
    model = transformers_model(path)
    cache = DynamicCache(config=model.config)

    @torch.inference_mode()
    def reference(ids):
        # logits_to_keep=1, as generate() does (all positions' logits take a larger
        # product, which differs in the last ulp).
        return model(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]

    expected, tokens = generate(reference)
    got, _ = generate(Split(stored).step)
    for i, (ours, theirs) in enumerate(zip(got, expected)):
        assert torch.equal(ours, theirs), f"step {i}: max diff {(ours - theirs).abs().max().item()}"
    assert len(set(tokens)) > 2  # the random model does not just repeat a token
    # Read straight from the checkpoint (tensors at the file's offsets): the same bits.
    assert all(torch.equal(a, b) for a, b in zip(generate(Split(path).step)[0], got))


def test_the_sliding_window_shapes_the_output(checkpoint, tmp_path):
    """The tests' sequences outrun the window: the same weights without it compute other
    logits (so the bit-identity above covers the windowed masks and caches)."""
    name, path = checkpoint
    if SLIDING not in layer_types(json.loads((path / "config.json").read_text())):
        pytest.skip(f"{name} has no sliding-window layers")
    wide = shutil.copytree(path, tmp_path / "wide")
    config = json.loads((wide / "config.json").read_text())
    assert config["sliding_window"] == WINDOW
    config["sliding_window"] = 256
    (wide / "config.json").write_text(json.dumps(config))
    windowed, _ = generate(Split(path).step)
    unwindowed, _ = generate(Split(wide).step)
    assert torch.equal(windowed[0], unwindowed[0])  # 3 tokens: inside the window
    assert not torch.equal(windowed[-1], unwindowed[-1])


def test_batched_decode_agrees_with_unbatched(checkpoint):
    """N sessions' decode steps in one forward agree with each session's own forwards
    within rounding (their rows come from one matrix product: model/batched.py)."""
    _, path = checkpoint
    runner, head = SpanRunner.load(path, 1, 4), ConsumerHead.load(path)
    prompts = [PROMPT, PROMPT[:2], [5, 6, 7, 8, 9, 10]]
    alone, together = [runner.new_cache() for _ in prompts], [runner.new_cache() for _ in prompts]
    for prompt, a, b in zip(prompts, alone, together):
        for cache in (a, b):
            runner.forward(head.embed_tokens(prompt), cache, 0, 1, 4)
    positions = [len(p) for p in prompts]
    for step in range(DECODE_STEPS):
        steps = [head.embed_tokens([40 + 7 * step + i]) for i in range(len(prompts))]
        expected = [runner.forward(h, cache, pos, 1, 4) for h, cache, pos in zip(steps, alone, positions)]
        got = decode_batch(runner, steps, together, positions, 1, 4)
        for ours, theirs in zip(got, expected):
            assert (ours - theirs).norm() <= 1e-5 * theirs.norm()  # the protocol's fp32 tolerance is 1e-3
        positions = [p + 1 for p in positions]


def test_rejected_drafts_leave_nothing_across_the_window(checkpoint):
    """Speculation: drafts pushed past the window and rolled back, then other tokens, give
    what a session that never saw the drafts gives (sliding layers included)."""
    _, path = checkpoint
    fresh = Split(path)
    fresh.step(PROMPT)
    expected = fresh.step([9, 8])
    split = Split(path)
    split.step(PROMPT)
    split.step([70, 71, 72, 73, 74])  # more drafts than the window holds
    split.truncate(len(PROMPT))
    assert torch.equal(split.step([9, 8]), expected)


@pytest.mark.parametrize("fmt", ["int8", "q4/g32"])
def test_quantized_spans_run(checkpoint, tmp_path, fmt):
    """Every family quantizes (Phi-3's fused qkv_proj and gate_up_proj included) and runs
    through the lean forward's kernels; a split equals the whole span exactly."""
    name, path = checkpoint
    if FAMILIES[name].moe:  # our quantizers are for 2-D projections: MoE files come quantized as GGUF
        with pytest.raises(UsageError, match="a quantized mixture of experts is imported as a GGUF file"):
            import_path(path, tmp_path / "data", alias="m", fmt=fmt)
        assert not (tmp_path / "data").exists() or not [p for p in (tmp_path / "data").rglob("*") if p.is_file()]
        return
    stored = import_path(path, tmp_path / "data", alias="m", fmt=fmt)
    whole = Split(stored.path, [(0, 4)])
    split = Split(stored.path, [(0, 2), (2, 4)])
    for runner in split.runners:
        assert runner.format_label == fmt
        kernels = [m for layer in runner.layers.values() for m in layer.modules()
                   if isinstance(m, (Int8Linear, Int4CpuLinear))]
        assert len(kernels) >= 4 * len(runner.layers)  # qkv (or q + kv), o, gate_up, down
        assert not any(isinstance(m, torch.nn.Linear) for layer in runner.layers.values() for m in layer.modules())
    ours, tokens = generate(split.step)
    theirs, _ = generate(whole.step)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()


def test_models_import_refuses_an_unservable_model_before_storing_it(tmp_path):
    from compushare.errors import UsageError
    from compushare.model.store import ModelStore

    source = make_tiny_family("llama", tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (source / "config.json").write_text(json.dumps(config))
    data = tmp_path / "data"
    with pytest.raises(UsageError, match="no node could serve it: unsupported architecture GPT2LMHeadModel") as refused:
        import_path(source, data, alias="gpt")
    assert all(family.title in str(refused.value) for family in FAMILIES.values())
    assert ModelStore(data).list() == []
    assert not [path for path in data.rglob("*") if path.is_file()]
    with pytest.raises(ModelUnavailable, match="unsupported architecture GPT2LMHeadModel"):
        SpanRunner.load(source, 0, 1)  # a node given such a model (fetched by id) refuses it too


def test_private_layers_run_every_family(checkpoint):
    """Private mode's consumer side (model/private_layers.py: transformers' own layers,
    each projection group asked for) with exact products reproduces the span runner,
    sliding windows, Gemma's norms and Phi-3's fused groups included. The products are
    computed from he/groups.py's stacked group weights, as a provider encrypts them."""
    from compushare.he.groups import GROUPS, group_shapes, group_weight
    from compushare.model.arch import load_config
    from compushare.model.private_layers import PrivateLayers
    from compushare.model.weights import read_tensors

    name, path = checkpoint
    if FAMILIES[name].moe:
        with pytest.raises(PrivateModeUnsupported, match="mixture of experts' routing is not encrypted"):
            PrivateLayers.load(path, lambda *_: None)
        return
    config = load_config(path)
    state = read_tensors(path, lambda names: [n for n in names if n.endswith("_proj.weight")])
    weights = {(layer, group): torch.from_numpy(group_weight(state, layer, group))
               for layer in range(config.num_hidden_layers) for group in GROUPS}
    asked = []

    def project(layer, group, x):
        assert tuple(weights[(layer, group)].shape) == group_shapes(config)[group]
        asked.append((layer, group))
        return (x.double() @ weights[(layer, group)].T).to(x.dtype)

    private, runner, head = PrivateLayers.load(path, project), SpanRunner.load(path, 0, 4), ConsumerHead.load(path)
    caches, tokens = (private.new_cache(), runner.new_cache()), ([], [])
    ids, length = PROMPT, 0
    for _ in range(4):
        hidden = head.embed_tokens(ids)
        ours, theirs = private.forward(hidden, caches[0], length), runner.forward(hidden, caches[1], length)
        assert (ours - theirs).norm() <= 1e-5 * theirs.norm()
        length += len(ids)
        tokens[0].append(int(head.logits(ours).argmax()))
        tokens[1].append(int(head.logits(theirs).argmax()))
        ids = tokens[1][-1:]
    assert tokens[0] == tokens[1]
    assert len(asked) == 4 * 4 * len(GROUPS)  # 4 steps, 4 layers, one product per group


def test_private_mode_refuses_layers_it_cannot_encrypt(tmp_path, monkeypatch):
    """A family whose layers hold a projection no encrypted group covers is refused,
    naming it (here Phi-3, with its fused qkv_proj's group entry taken away)."""
    from compushare.model import private_layers
    from compushare.errors import PrivateModeUnsupported
    from compushare.model.private_layers import PrivateLayers

    path = make_tiny_family("phi3", tmp_path / "phi3")
    monkeypatch.delitem(private_layers.GROUP_OF, "qkv_proj")
    with pytest.raises(PrivateModeUnsupported, match="private mode cannot run Phi-3: its layers' self_attn.qkv_proj"):
        PrivateLayers.load(path, project=None)
