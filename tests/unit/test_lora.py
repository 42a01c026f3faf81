"""LoRA against PEFT in one process: span_forward and span_backward (model/span_training.py)
compute what transformers' model wrapped by PEFT computes, forward and gradients; and
adapter files (model/adapter_file.py) go both ways between PEFT and CompuShare.
(The wire form and the server's cache: tests/unit/test_adapter_wire.py.)"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from compushare.errors import UsageError
from compushare.model import adapter_file
from compushare.model.arch import load_config
from compushare.model.blocks import SpanRunner
from compushare.model.head import ConsumerHead
from compushare.model.lora import Adapter, LoraSpec
from compushare.model.span_training import span_backward, span_forward
from helpers import random_adapter, reference_model
from tiny_families import make_tiny_family

pytestmark = pytest.mark.unit

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."


def peft_wrapped(model_dir, adapter: Adapter, **reference):
    """transformers' float32 model of `model_dir` with PEFT's LoRA holding `adapter`'s tensors."""
    spec = adapter.spec
    model = get_peft_model(reference_model(model_dir, **reference),
                           LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                                      lora_dropout=0.0, use_rslora=spec.rslora))
    loaded = model.load_state_dict({PEFT_PREFIX + k.replace(".weight", ".default.weight"): v
                                    for k, v in adapter.tensors.items()}, strict=False)
    assert not loaded.unexpected_keys
    return model


def decoder_layers(model) -> torch.nn.Module:
    """The wrapped model's decoder stack without its final norm: inputs_embeds in, the
    last layer's output out (what a span 0:end computes)."""
    inner = model.base_model.model.model
    inner.norm = torch.nn.Identity()
    return inner


def peft_grads(model) -> dict[str, torch.Tensor]:
    return {n.removeprefix(PEFT_PREFIX).replace(".default", ""): p.grad for n, p in model.named_parameters()
            if "lora_" in n}


@pytest.fixture(scope="module")
def llama(tiny_model):
    config = load_config(tiny_model)
    return tiny_model, config, SpanRunner.load(tiny_model, 0, 4), random_adapter(config, targets=ALL, seed=3)


def inputs(seed: int = 5, rows: int = 2, tokens: int = 7, hidden: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, tokens, hidden, generator=generator), torch.randn(rows, tokens, hidden,
                                                                                generator=generator)


def test_span_forward_is_peft_forward(llama):
    model_dir, _, runner, adapter = llama
    hidden, _ = inputs()
    ours = span_forward(runner, hidden, adapter, 0, 4)
    with torch.inference_mode():
        theirs = decoder_layers(peft_wrapped(model_dir, adapter))(inputs_embeds=hidden).last_hidden_state
    assert torch.equal(ours, theirs), f"max diff {(ours - theirs).abs().max().item()}"
    # The adapter changes the output (else the comparison would show nothing).
    assert (span_forward(runner, hidden, None, 0, 4) - ours).abs().max() > 1e-3


def test_span_backward_is_peft_autograd(llama):
    model_dir, _, runner, adapter = llama
    hidden, grad_output = inputs()
    model = peft_wrapped(model_dir, adapter)
    leaf = hidden.clone().requires_grad_(True)
    (decoder_layers(model)(inputs_embeds=leaf).last_hidden_state * grad_output).sum().backward()
    expected = peft_grads(model)

    grad_input, grads = span_backward(runner, hidden, grad_output, adapter, 0, 4)
    torch.testing.assert_close(grad_input, leaf.grad, rtol=0, atol=1e-5)
    assert set(grads) == set(expected) == set(adapter.tensors)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name  # B nonzero: every factor, A included, has a gradient
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-5, msg=name)
    assert all(not p.requires_grad for p in runner.layers[0].parameters())  # frozen, and left so


def test_span_backward_chains_across_split_spans(llama):
    """Two servers' backwards, 2:4 then 0:2, are one server's over 0:4."""
    _, _, runner, adapter = llama
    hidden, grad_output = inputs(seed=9)
    whole_input, whole = span_backward(runner, hidden, grad_output, adapter, 0, 4)
    middle = span_forward(runner, hidden, adapter.span(0, 2), 0, 2)
    grad_middle, upper = span_backward(runner, middle, grad_output, adapter.span(2, 4), 2, 4)
    grad_input, lower = span_backward(runner, hidden, grad_middle, adapter.span(0, 2), 0, 2)
    torch.testing.assert_close(grad_input, whole_input, rtol=0, atol=1e-6)
    assert set(lower) | set(upper) == set(whole) and not set(lower) & set(upper)
    for name, grad in (lower | upper).items():
        torch.testing.assert_close(grad, whole[name], rtol=0, atol=1e-6, msg=name)


def test_span_backward_without_adapter_and_outside_the_span(llama):
    _, _, runner, _ = llama
    hidden, grad_output = inputs(rows=1)
    grad_input, grads = span_backward(runner, hidden, grad_output, None, 0, 4)
    assert grads == {} and grad_input.shape == hidden.shape and grad_input.abs().max() > 0
    with pytest.raises(ValueError, match="outside served span"):
        span_backward(SpanRunner.load(llama[0], 1, 3), hidden, grad_output, None, 0, 2)


@pytest.mark.parametrize("family, targets, rslora", [
    ("qwen2", ("q_proj", "k_proj", "v_proj", "down_proj"), True),  # biased q, k, v; rsLoRA's scaling
    ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), False),  # fused matrices, adapted whole
])
def test_other_families_forward_is_peft_forward(family, targets, rslora, tmp_path):
    from compushare.model.families import family_of_config

    path = make_tiny_family(family, tmp_path / family)
    config = load_config(path)
    base = random_adapter(config, targets=targets, seed=11)
    adapter = Adapter(LoraSpec(base.spec.rank, base.spec.alpha, targets, rslora), base.tensors)
    hidden, _ = inputs(seed=2, tokens=9)  # longer than Phi-3's sliding window
    ours = span_forward(SpanRunner.load(path, 0, 4), hidden, adapter, 0, 4)
    attention = family_of_config(json.loads((path / "config.json").read_text())).attention
    with torch.inference_mode():
        wrapped = decoder_layers(peft_wrapped(path, adapter, attn_implementation=attention))
        theirs = wrapped(inputs_embeds=hidden).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


# --- adapter files ---------------------------------------------------------------------

def adapted_logits(model_dir, adapter: Adapter, ids: list[int]) -> torch.Tensor:
    runner, head = SpanRunner.load(model_dir, 0, 4), ConsumerHead.load(model_dir)
    hidden = runner.forward(head.embed_tokens(ids), runner.new_cache(), 0, adapter=adapter)
    return head.logits_rows(hidden)


def test_a_saved_adapter_loads_in_peft_and_computes_the_same(llama, tmp_path):
    model_dir, _, _, adapter = llama
    saved = adapter_file.save(adapter, tmp_path / "adapter", base_model=str(model_dir))
    assert sorted(p.name for p in saved.iterdir()) == [adapter_file.CONFIG_FILE, adapter_file.WEIGHTS_FILE]
    wrapped = PeftModel.from_pretrained(reference_model(model_dir), str(saved)).eval()
    ids = [1, 17, 42, 99, 3, 200, 7]
    with torch.inference_mode():
        theirs = wrapped(input_ids=torch.tensor([ids])).logits[0]
    ours = adapted_logits(model_dir, adapter, ids).reshape(theirs.shape)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # PEFT took every factor: its state is ours, bit for bit.
    state = {k.replace(".default", ""): v for k, v in wrapped.state_dict().items() if "lora_" in k}
    assert state.keys() == {PEFT_PREFIX + k for k in adapter.tensors}
    assert all(torch.equal(state[PEFT_PREFIX + k], v) for k, v in adapter.tensors.items())


def test_a_peft_saved_adapter_loads_here_to_the_same_tensors(llama, tmp_path):
    model_dir, config, _, adapter = llama
    peft_wrapped(model_dir, adapter).save_pretrained(str(tmp_path / "peft"))
    loaded = adapter_file.load(tmp_path / "peft", model_id="some-model", config=config)
    assert loaded.spec == adapter.spec and loaded.model_id == "some-model"  # PEFT names no model id of ours
    assert loaded.tensors.keys() == adapter.tensors.keys()
    assert all(torch.equal(loaded.tensors[k], v) for k, v in adapter.tensors.items())
    assert loaded.digest() == adapter.digest()


@pytest.mark.parametrize("name", ["adapter", "adapter.safetensors"])
def test_files_round_trip_and_name_their_model(llama, tmp_path, name):
    model_dir, config, _, base = llama
    adapter = adapter_file.with_model(base, "model-x")
    path = adapter_file.save(adapter, tmp_path / name)
    assert path.is_file() == name.endswith(".safetensors")
    loaded = adapter_file.load(path, model_id="model-x", config=config)
    assert loaded.model_id == "model-x" and loaded.spec == adapter.spec and loaded.digest() == adapter.digest()
    assert adapter_file.load(path).model_id == "model-x"
    with pytest.raises(UsageError, match="not on model-y"):
        adapter_file.load(path, model_id="model-y")
    adapter_file.save(adapter_file.with_model(base, "model-z"), path)  # overwrites in place
    assert adapter_file.load(path).model_id == "model-z"
    assert not list(tmp_path.rglob("*.partial"))


@pytest.mark.parametrize("change, message", [
    (dict(intermediate_size=96), "do not fit"),
    (dict(num_hidden_layers=2), "the model has 2"),
])
def test_an_adapter_that_does_not_fit_the_model_is_refused(llama, tmp_path, change, message):
    _, config, _, adapter = llama
    other = copy.deepcopy(config)
    for key, value in change.items():
        setattr(other, key, value)
    path = adapter_file.save(adapter, tmp_path / "a.safetensors")
    with pytest.raises(UsageError, match=message):
        adapter_file.load(path, config=other)


@pytest.mark.parametrize("option, value", [("use_dora", True), ("rank_pattern", {"q_proj": 8}),
                                           ("alpha_pattern", {"v_proj": 4}), ("layers_to_transform", [0]),
                                           ("modules_to_save", ["lm_head"]), ("bias", "all"),
                                           ("target_modules", "all-linear"), ("peft_type", "IA3")])
def test_unsupported_peft_options_are_refused_naming_them(llama, tmp_path, option, value):
    _, _, _, adapter = llama
    path = adapter_file.save(adapter, tmp_path / "adapter")
    config_file = path / adapter_file.CONFIG_FILE
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {option: value}))
    with pytest.raises(UsageError, match=option):
        adapter_file.load(path)


@pytest.mark.parametrize("damage", ["no file", "not safetensors", "no config", "config not JSON",
                                    "config not a map", "alpha too large"])
def test_damaged_adapter_files_are_refused_with_usage_errors(llama, tmp_path, damage):
    _, _, _, adapter = llama
    path = adapter_file.save(adapter, tmp_path / "adapter")
    weights, config_file = path / adapter_file.WEIGHTS_FILE, path / adapter_file.CONFIG_FILE
    if damage == "no file":
        weights.unlink()
    elif damage == "not safetensors":
        weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    elif damage == "no config":
        config_file.unlink()
    elif damage == "config not JSON":
        config_file.write_text("{")
    elif damage == "config not a map":
        config_file.write_text("[1]")
    else:  # JSON's integers have no bound; a float's do
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"lora_alpha": 10 ** 400}))
    with pytest.raises(UsageError):
        adapter_file.load(path)
