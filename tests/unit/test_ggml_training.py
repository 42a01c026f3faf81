"""A span on ggml trains on torch a layer at a time (model/span_training.LayerTwins):
its forward and its gradients, the input's and an adapter's over several layers,
equal a torch span's on the same GGUF file."""

from pathlib import Path

import torch

from compushare.model.arch import load_config
from compushare.model.catalog import import_path
from compushare.model.lora import Adapter, LoraSpec
from compushare.model.span_training import span_backward, span_forward
from compushare.spans import load_span

GGUF = Path(__file__).resolve().parents[1] / "data" / "gguf" / "tiny-qwen2-q8_0.gguf"


def test_a_ggml_span_trains_as_a_torch_span_of_the_same_file(tmp_path):
    stored = import_path(GGUF, tmp_path / "home", alias="q8", fmt="gguf")
    on_ggml, on_torch = load_span(stored.path, 0, 2), load_span(stored.path, 0, 2, runtime="torch")
    assert on_ggml.runtime == "ggml" and on_torch.runtime == "torch"
    adapter = Adapter.initialised(LoraSpec(4, 8.0, ("q_proj", "v_proj", "down_proj")), load_config(stored.path),
                                  range(2), seed=1, model_id=stored.model_id)
    generator = torch.Generator().manual_seed(2)
    for name, tensor in adapter.tensors.items():
        if "lora_B" in name:  # not zero: every factor gets a gradient
            tensor.normal_(0, 0.05, generator=generator)
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
