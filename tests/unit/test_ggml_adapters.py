"""LoRA adapters on ggml spans (spans/ggml/adapter.py): a prompt and decode steps with
an adapter equal the torch runtime's with the same adapter on the same file (a Llama
file's permuted q / k rows, Qwen2's biases, Phi-3's fused projections), an adapter
for projections the model lacks is refused, and the span keeps only its last few
adapters uploaded, computing the same after one is dropped and uploaded again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compushare.errors import UsageError
from compushare.model.arch import load_config
from compushare.model.catalog import import_path
from compushare.model.lora import Adapter, LoraSpec
from compushare.spans import GGML, TORCH, load_span
from compushare.spans.ggml.span import MAX_ADAPTERS

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data" / "gguf"
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = {"tiny-llama-f32.gguf": ALL, "tiny-qwen2-f32.gguf": ALL, "tiny-qwen2-q8_0.gguf": ALL}


def adapter_of(model, targets, seed: int = 0) -> Adapter:
    config = load_config(model.path)
    adapter = Adapter.initialised(LoraSpec(4, 8.0, targets), config, range(config.num_hidden_layers), seed=seed,
                                  model_id=model.model_id)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in adapter.tensors.items():
        if "lora_B" in name:  # not zero: the adapter changes every output
            tensor.normal_(0, 0.2, generator=generator)
    return adapter


def steps(span, adapter, tokens: int = 5, decode: int = 3) -> torch.Tensor:
    """A prompt of `tokens` then `decode` single-token steps, outputs concatenated."""
    generator = torch.Generator().manual_seed(11)
    cache, outs = span.new_cache(), []
    hidden = torch.randn(1, tokens, span.hidden_size, generator=generator)
    outs.append(span.forward(hidden, cache, 0, adapter=adapter))
    for step in range(decode):
        one = torch.randn(1, 1, span.hidden_size, generator=generator)
        outs.append(span.forward(one, cache, tokens + step, adapter=adapter))
    return torch.cat(outs, dim=1).float()


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    root = tmp_path_factory.mktemp("ggml-adapters")
    return lambda name: import_path(DATA / name, root / name, alias="x")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_an_adapter_on_ggml_computes_what_it_does_on_torch(stored, name):
    """Within the runtimes' own difference without an adapter (ggml keeps the KV cache in
    float16, and on Q8_0 rounds activations to 8 bits where torch's kernel takes
    bfloat16), while the adapter moves the outputs by their whole size."""
    model = stored(name)
    on_ggml, on_torch = load_span(model.path, 0, 2, runtime=GGML), load_span(model.path, 0, 2, runtime=TORCH)
    adapter = adapter_of(model, TARGETS[name])
    expected = steps(on_torch, adapter)
    scale = expected.abs().max()
    runtimes = (steps(on_ggml, None) - steps(on_torch, None)).abs().max() / scale
    assert runtimes <= (2e-3 if "f32" in name else 6e-2)
    assert (steps(on_ggml, adapter) - expected).abs().max() / scale <= 3 * runtimes
    assert (steps(on_ggml, adapter) - steps(on_ggml, None)).abs().max() / scale > 0.5


def test_an_adapter_for_projections_the_model_lacks_is_refused(stored):
    model = stored("tiny-phi3-f32.gguf")  # fused: no q_proj of its own
    span = load_span(model.path, 0, 2, runtime=GGML)
    with pytest.raises(UsageError, match="q_proj"):
        steps(span, adapter_of(model, ("q_proj",)))
    assert torch.equal(steps(span, None), steps(span, None))  # the span serves on


def test_the_span_keeps_its_last_adapters_and_computes_the_same_after_one_comes_back(stored):
    model = stored("tiny-llama-f32.gguf")
    span = load_span(model.path, 0, 2, runtime=GGML)
    adapters = [adapter_of(model, ALL, seed=i) for i in range(MAX_ADAPTERS + 1)]
    first = steps(span, adapters[0])
    for adapter in adapters[1:]:
        steps(span, adapter)
    assert len(span._adapters) == MAX_ADAPTERS and id(adapters[0]) not in span._adapters
    assert all(key[6] in span._adapters or key[6] == 0 for key in span._graphs)  # the dropped one's graphs went too
    assert torch.equal(steps(span, adapters[0]), first)
