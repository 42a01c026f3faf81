"""A span on ggml trains on torch a layer at a time (model/span_training.LayerTwins):
its forward and its gradients, the input's and an adapter's over several layers,
equal a torch span's on the same GGUF file."""

from pathlib import Path

import torch

from compushare.model.arch import load_config
from compushare.model.catalog import import_path
from compushare.model.lora import Adapter, LoraSpec
from compushare.model.span_training import LayerTwins, span_backward, span_forward
from compushare.spans import load_span

GGUF = Path(__file__).resolve().parents[1] / "data" / "gguf" / "tiny-qwen2-q8_0.gguf"


def small_adapter(stored) -> Adapter:
    adapter = Adapter.initialised(LoraSpec(4, 8.0, ("q_proj", "v_proj", "down_proj")), load_config(stored.path),
                                  range(2), seed=1, model_id=stored.model_id)
    generator = torch.Generator().manual_seed(2)
    for name, tensor in adapter.tensors.items():
        if "lora_B" in name:  # not zero: every factor gets a gradient
            tensor.normal_(0, 0.05, generator=generator)
    return adapter


def test_a_ggml_span_trains_as_a_torch_span_of_the_same_file(tmp_path):
    stored = import_path(GGUF, tmp_path / "home", alias="q8", fmt="gguf")
    on_ggml, on_torch = load_span(stored.path, 0, 2), load_span(stored.path, 0, 2, runtime="torch")
    assert on_ggml.runtime == "ggml" and on_torch.runtime == "torch"
    adapter = small_adapter(stored)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, on_torch.hidden_size, generator=generator)
    grad_output = torch.randn(2, 7, on_torch.hidden_size, generator=generator)
    assert torch.equal(span_forward(on_ggml, hidden, adapter, 0, 2), span_forward(on_torch, hidden, adapter, 0, 2))
    grad_ggml, adapter_ggml = span_backward(on_ggml, hidden, grad_output, adapter, 0, 2)
    grad_torch, adapter_torch = span_backward(on_torch, hidden, grad_output, adapter, 0, 2)
    assert torch.equal(grad_ggml, grad_torch)
    assert adapter_ggml.keys() == adapter_torch.keys() == adapter.tensors.keys()
    for name in adapter_torch:  # both layers' factors: none lost between the layers' backwards
        assert torch.equal(adapter_ggml[name], adapter_torch[name]), name
        assert adapter_torch[name].abs().max() > 0, name


def test_twins_kept_within_their_bytes_are_not_built_again_and_change_nothing(tmp_path):
    stored = import_path(GGUF, tmp_path / "home", alias="q8", fmt="gguf")
    span = load_span(stored.path, 0, 2)
    adapter = small_adapter(stored)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 5, span.hidden_size, generator=generator)
    grad_output = torch.randn(1, 5, span.hidden_size, generator=generator)
    fresh = span_backward(span, hidden, grad_output, adapter, 0, 2)  # no twins kept: every layer built, twice
    one_layer = LayerTwins(span).layer(0).weight_bytes
    span.twins = LayerTwins(span, keep_bytes=one_layer)  # room for the first layer built, not for both
    first = span_backward(span, hidden, grad_output, adapter, 0, 2)
    assert list(span.twins.kept) == [0] and span.twins.kept_bytes == one_layer <= span.twins.keep_bytes
    assert span.twins.built == 3  # forward: layers 0 (kept) and 1; backward: layer 1 again
    again = span_backward(span, hidden, grad_output, adapter, 0, 2)
    assert span.twins.built == 5  # layer 1, twice: never kept, never evicting layer 0
    for result in (first, again):
        assert torch.equal(result[0], fresh[0])
        assert all(torch.equal(result[1][name], fresh[1][name]) for name in fresh[1])


def test_with_every_twin_kept_a_backward_is_one_graph_and_the_same(tmp_path):
    stored = import_path(GGUF, tmp_path / "home", alias="q8", fmt="gguf")
    span = load_span(stored.path, 0, 2)
    adapter = small_adapter(stored)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 6, span.hidden_size, generator=generator)
    grad_output = torch.randn(2, 6, span.hidden_size, generator=generator)
    layer_at_a_time = span_backward(span, hidden, grad_output, adapter, 0, 2)
    span.twins = LayerTwins(span, keep_bytes=1 << 30)
    span_forward(span, hidden, adapter, 0, 2)  # builds both layers: both kept
    assert span.twins.holds(0, 2) and span.twins.built == 2
    one_graph = span_backward(span, hidden, grad_output, adapter, 0, 2)
    assert span.twins.built == 2  # nothing built again
    assert torch.allclose(one_graph[0], layer_at_a_time[0], rtol=0, atol=1e-6 * layer_at_a_time[0].abs().max())
    for name, expected in layer_at_a_time[1].items():
        assert torch.allclose(one_graph[1][name], expected, rtol=0, atol=1e-6 * expected.abs().max()), name
