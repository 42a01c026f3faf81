"""The ggml span runtime on the GGUF fixtures: its bindings, masks, caches and the
invariants a server relies on (a span split in two, a prompt paused between layers, a
cache grown or rolled back: all bit-identical to the plain forward)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from compushare.errors import UsageError
from compushare.model import gguf_native
from compushare.model.arch import config_fields, load_config
from compushare.model.catalog import import_path
from compushare.spans import GGML, TORCH, load_head, load_span, runtime_for
from compushare.spans.ggml import lib
from compushare.spans.ggml.recipe import inverse_sqrt, llama3_factors, recipe_of
from compushare.spans.ggml.span import KV_PAD, causal_mask
from gguf_files import Q4_K_M, write_tiny_llama

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data" / "gguf"


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """name -> the fixture imported into a store (`models import --format gguf`)."""
    root = tmp_path_factory.mktemp("ggml")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = import_path(DATA / name, root / name, alias="x")
        return cache[name]
    return get


def test_every_handle_ggml_python_misdeclares_comes_back_whole():
    # ggml-python 0.0.45 declares these as returning typing.NewType(int): ctypes read the
    # pointer as a C int and the next call with it crashed the process.
    assert {"ggml_backend_cpu_buffer_type", "ggml_backend_alloc_buffer"} <= set(lib.FIXED)
    assert lib.misdeclared() == []
    g = lib.ggml
    # The same buffer type reached through a correctly declared call: a truncated pointer differs.
    assert g.ggml_backend_cpu_buffer_type() == g.ggml_backend_dev_buffer_type(lib.cpu_device())
    assert g.ggml_backend_buft_name(g.ggml_backend_cpu_buffer_type()) == b"CPU"


def test_causal_masks_hide_the_future_and_what_slides_out_of_the_window():
    mask = causal_mask(3, 2, 8)
    assert mask.dtype == np.float16 and mask.shape == (2, 8)
    assert np.isneginf(mask).tolist() == [[False] * 4 + [True] * 4, [False] * 5 + [True] * 3]
    windowed = causal_mask(5, 1, 8, window=2)
    assert np.isneginf(windowed[0]).tolist() == [True] * 4 + [False] * 2 + [True] * 2


FIXTURES = sorted(p.name for p in DATA.glob("*.gguf"))


@pytest.mark.parametrize("name", FIXTURES)
def test_the_recipe_from_config_json_alone_is_the_one_from_transformers_config(stored, name):
    """A ggml node reads config.json without transformers (some 100 MB of a node's
    memory): every family's recipe comes out the same as from its transformers config."""
    model = stored(name)
    assert recipe_of(config_fields(model.path)) == recipe_of(load_config(model.path))


def test_llama3_rope_factors_are_the_files_own(stored):
    # Our store keeps no rope_freqs tensor (its values became the config's rope
    # parameters): the recipe recomputes them, bit for bit what the file holds.
    model = stored("tiny-llama-f32.gguf")
    reader = {t.name: t for t in gguf.GGUFReader(str(DATA / "tiny-llama-f32.gguf")).tensors}
    recipe = recipe_of(model.manifest.config)
    assert np.array_equal(np.asarray(recipe.ropes[0].factors, dtype=np.float32),
                          np.asarray(reader["rope_freqs.weight"].data, dtype=np.float32))
    assert recipe.ropes[0].factors == tuple(llama3_factors(model.manifest.config["rope_parameters"], 500000.0,
                                                           16).tolist())
    assert inverse_sqrt(128) == float(np.float32(1) / np.sqrt(np.float32(128)))
    rows = np.arange(64 * 3).reshape(64, 3)  # the load's q/k row order and the import's are inverses
    assert np.array_equal(gguf_native.unpermute(gguf_native.permute(rows, 4), 4), rows)


def _prompt(span, tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, tokens, span.hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["tiny-llama-f32.gguf", "tiny-gemma2-f32.gguf", "tiny-phi3-f32.gguf"])
def test_a_span_split_in_two_and_a_prompt_paused_between_layers_equal_the_whole(stored, name):
    model = stored(name)
    whole = load_span(model.path, 0, 2, runtime=GGML)
    first, second = load_span(model.path, 0, 1, runtime=GGML), load_span(model.path, 1, 2, runtime=GGML)
    assert whole.runtime == GGML and whole.format_label == "gguf"
    prompt, step = _prompt(whole, 7), _prompt(whole, 1, seed=1)
    caches = [whole.new_cache(), first.new_cache(), second.new_cache()]
    expected = whole.forward(prompt, caches[0], 0)
    assert torch.equal(second.forward(first.forward(prompt, caches[1], 0), caches[2], 0), expected)
    pauses = []
    paused_cache = whole.new_cache()
    assert torch.equal(whole.forward(prompt, paused_cache, 0, between_layers=lambda: pauses.append(1)), expected)
    assert len(pauses) == 2  # one graph per layer, the callback before each
    decoded = whole.forward(step, caches[0], 7)
    assert torch.equal(second.forward(first.forward(step, caches[1], 7), caches[2], 7), decoded)
    assert torch.equal(whole.forward(step, paused_cache, 7), decoded)


def test_a_cache_grown_past_its_padding_and_one_rolled_back_hold_the_same_tokens(stored):
    model = stored("tiny-qwen3-f32.gguf")
    span = load_span(model.path, 0, 2, runtime=GGML)
    steps = [_prompt(span, 1, seed=i) for i in range(KV_PAD + 8)]
    growing, roomy = span.new_cache(), span.new_cache()
    roomy.reserve(2 * KV_PAD)  # never grows
    for position, step in enumerate(steps):
        assert torch.equal(span.forward(step, growing, position), span.forward(step, roomy, position)), position
    assert growing.capacity == 2 * KV_PAD and span.cached_length(growing) == KV_PAD + 8
    # Speculation's rollback: the rewound cache computes what one that never saw the tail does.
    span.truncate(growing, 100)
    fresh = span.new_cache()
    for position, step in enumerate(steps[:100]):
        span.forward(step, fresh, position)
    other = _prompt(span, 3, seed=99)
    assert torch.equal(span.forward(other, growing, 100), span.forward(other, fresh, 100))
    with pytest.raises(ValueError, match="past the cache"):
        span.forward(other, fresh, 500)


def test_two_loads_of_one_build_compute_the_same_forwards_bit_for_bit_whatever_their_threads(tmp_path):
    """What the step proofs' exact comparison rests on (proofs/inference.py): one ggml
    build, the same forwards (a prompt in one, then tokens one at a time), any threads.
    A Q4_K_M file: repacked where this CPU offers it."""
    model = import_path(write_tiny_llama(tmp_path / "tiny-q4_k_m.gguf", Q4_K_M), tmp_path / "store", alias="x")
    one, two = (load_span(model.path, 0, 2, runtime=GGML, threads=n) for n in (1, 2))
    assert one.build == two.build and one.build.startswith("ggml/")
    caches = one.new_cache(), two.new_cache()
    steps = [_prompt(one, 9)] + [_prompt(one, 1, seed=i) for i in range(1, 6)]
    position = 0
    for step in steps:
        assert torch.equal(one.forward(step, caches[0], position), two.forward(step, caches[1], position))
        position += step.shape[1]


def test_placement_counts_a_ggml_block_at_what_ggml_holds_of_it(tmp_path):
    """A ggml node budgets a block at its file's bytes (the buffers it allocates, within
    their alignment) and its KV cache in float16, not at torch's kernels' bytes."""
    from compushare.pipeline.server.provider import MB, block_cost, blocks_for_budget, held_block_bytes, \
        kv_bytes_per_token

    model = import_path(write_tiny_llama(tmp_path / "tiny-q4_k_m.gguf", Q4_K_M), tmp_path / "store", alias="x")
    span = load_span(model.path, 0, 1, runtime=GGML)
    held = held_block_bytes(model, GGML)
    assert held == model.stored_block_bytes < model.block_bytes == held_block_bytes(model, TORCH)
    assert held <= span.weight_bytes <= held + 64 * 1024  # one block's buffers
    assert 2 * kv_bytes_per_token(model, GGML) == kv_bytes_per_token(model, TORCH)
    budget = 3 * block_cost(model, 256, GGML) // MB + 1
    assert blocks_for_budget(model, max_blocks=None, memory_budget_mb=budget, free_mb=0, kv_tokens=256,
                             runtime=GGML) >= 3 > blocks_for_budget(model, max_blocks=None, memory_budget_mb=budget,
                                                                    free_mb=0, kv_tokens=256)


def test_models_not_in_gguf_are_refused_with_the_runtime_that_serves_them(stored, tiny_model):
    model = stored("tiny-qwen2-f32.gguf")
    assert runtime_for(model.path) == GGML and runtime_for(model.path, TORCH) == TORCH
    assert runtime_for(tiny_model) == TORCH  # a safetensors model: torch, as always
    with pytest.raises(UsageError, match="--runtime torch"):
        runtime_for(tiny_model, GGML)


def test_the_ggml_head_is_the_torch_kernels_within_their_rounding(stored):
    model = stored("tiny-qwen2-q8_0.gguf")
    ggml_head, torch_head = load_head(model.path), load_head(model.path, runtime=TORCH)
    assert ggml_head.projector is not None and torch_head.projector is None
    hidden = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(3))
    a, b = ggml_head.logits_rows(hidden), torch_head.logits_rows(hidden)
    # ggml rounds the activations to Q8_0 before the product; torch's kernel holds bfloat16.
    assert torch.allclose(a, b, rtol=0, atol=3e-2 * b.abs().max().item())
    assert torch.equal(ggml_head.logits(hidden[:, :1]), ggml_head.logits_rows(hidden[:, :1])[0])


def test_the_recorded_llamacpp_tokens_name_the_files_they_came_from():
    recorded = json.loads((DATA / "llamacpp_tokens.json").read_text())
    index = json.loads((DATA / "fixtures.json").read_text())["files"]
    for name, entry in recorded["files"].items():
        if name in index:
            assert entry["sha256"] == index[name]["sha256"], name
        assert len(entry["tokens"]) == recorded["tokens"] == 64


def test_a_config_that_disagrees_with_its_tensors_is_refused_before_ggml_could_abort(stored):
    from compushare.model.arch import load_config
    from compushare.spans.ggml.load import load_ggml_span

    model = stored("tiny-qwen3-f32.gguf")
    lying = load_config(model.path)
    lying.num_attention_heads *= 2  # q's rows no longer heads x head size: ggml would assert in its product
    with pytest.raises(ValueError, match="the config says"):
        load_ggml_span(model.path, 0, 2, config=lying)
