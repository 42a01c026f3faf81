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
