"""Qwen2 runs through the same span code as Llama."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from compushare.model.blocks import SpanRunner
from compushare.model.head import ConsumerHead


def test_qwen2_split_matches_full_model(tmp_path):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).eval().save_pretrained(str(tmp_path))
    full = Qwen2ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="sdpa").eval()
    stages = [SpanRunner.load(tmp_path, 0, 1), SpanRunner.load(tmp_path, 1, 3)]
    head = ConsumerHead.load(tmp_path)
    caches = [s.new_cache() for s in stages]
    prompt = [3, 14, 15, 92, 65]
    with torch.inference_mode():
        expected = full.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    produced, position, chunk = [], 0, prompt
    for _ in range(8):
        hidden = head.embed_tokens(chunk)
        for stage, cache in zip(stages, caches):
            hidden = stage.forward(hidden, cache, position)
        position += len(chunk)
        chunk = [int(head.logits(hidden).argmax())]
        produced.append(chunk[0])
    assert produced == expected


def test_qwen2_quantized_keeps_its_projection_biases(tmp_path):
    """Qwen2's q, k and v projections have biases: a quantized span adds them after the
    kernel (fused q/k/v or k/v included), so it tracks fp32 as closely as Llama does."""
    from compushare.model.catalog import import_path
    from compushare.model.kernels import WithBias
    from compushare.proofs.inference import relative_error

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # biases that matter (transformers initialises them to zero)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(tmp_path / "hf"))
    reference = SpanRunner.load(tmp_path / "hf", 0, 2)
    x = ConsumerHead.load(tmp_path / "hf").embed_tokens([3, 14, 15, 92, 65])
    expected = reference.forward(x, reference.new_cache(), 0)
    for fmt in ("int8", "q4/g32"):
        stored = import_path(tmp_path / "hf", tmp_path / fmt.replace("/", "_"), alias="q", fmt=fmt)
        runner = SpanRunner.load(stored.path, 0, 2)
        attn = runner.layers[0].self_attn
        fused = getattr(attn, "qkv_proj", None) or attn.kv_proj
        assert isinstance(fused, WithBias)
        got = runner.forward(x, runner.new_cache(), 0)
        error = relative_error(got.numpy(), expected.numpy())
        assert error < {"int8": 0.02, "q4/g32": 0.12}[fmt], (fmt, error)
        for layer in runner.layers.values():  # without its biases the span is far off
            attention = layer.self_attn
            (getattr(attention, "qkv_proj", None) or attention.kv_proj).bias.zero_()
        unbiased = runner.forward(x, runner.new_cache(), 0)
        assert relative_error(unbiased.numpy(), expected.numpy()) > 3 * error
