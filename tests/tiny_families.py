"""A tiny random checkpoint of each model family (model/families.py), built offline
with transformers' own config classes: hidden 64, 4 layers, vocabulary 256, so a
whole model runs in milliseconds. Each config turns on what makes its family
differ (rope scaling, QK-norm, a sliding window shorter than the tests' sequences,
soft-capping, a query scale other than the head size, two rope bases (Gemma 3's
global one scaled linearly, as its larger models' are), fused projections), and every weight, norms and
biases included, is random (transformers initialises norms and biases to
constants, which would hide a missing (1 + w) or bias)."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 4  # sliding windows: shorter than every test's prompt plus decode
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, initializer_range=0.3)
# Gemma scales its embeddings by sqrt(64) = 8: at the others' spread one token wins every step.
GEMMA = COMMON | dict(initializer_range=0.02)


def _configs():
    from transformers import (Gemma2Config, Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    return {  # each takes overrides of its fields (`tiny_config`)
        "llama": lambda o: LlamaConfig(**COMMON | dict(tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}) | o),
        "qwen2": lambda o: Qwen2Config(**COMMON | dict(tie_word_embeddings=True) | o),
        "qwen3": lambda o: Qwen3Config(**COMMON | dict(tie_word_embeddings=True) | o),
        "mistral": lambda o: MistralConfig(**COMMON | dict(sliding_window=WINDOW, tie_word_embeddings=False) | o),
        "gemma2": lambda o: Gemma2Config(**GEMMA | dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                        attn_logit_softcapping=1.5, final_logit_softcapping=0.5) | o),
        "gemma3": lambda o: Gemma3TextConfig(**GEMMA | dict(
            sliding_window=WINDOW, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}) | o),
        "phi3": lambda o: Phi3Config(**COMMON | dict(sliding_window=WINDOW, tie_word_embeddings=False) | o),
        # Mixtures of experts: 8 experts, 2 a token (every layer sparse), so a 7-token prompt
        # routes to most of them; gpt-oss alternates sliding and full layers, as its own do.
        "qwen3_moe": lambda o: Qwen3MoeConfig(**COMMON | dict(
            tie_word_embeddings=False, moe_intermediate_size=32, num_experts=EXPERTS, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]) | o),
        "mixtral": lambda o: MixtralConfig(**COMMON | dict(intermediate_size=32, num_local_experts=EXPERTS,
                                                           num_experts_per_tok=2, tie_word_embeddings=False) | o),
        "gpt_oss": lambda o: GptOssConfig(**COMMON | dict(
            intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=WINDOW,
            tie_word_embeddings=False, rope_parameters={  # YaRN, as gpt-oss's own, over a short original context
                "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 150000.0},
            layer_types=["sliding_attention", "full_attention"] * 2) | o),
    }


EXPERTS = 8
DENSE_FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")
MOE_FAMILY_NAMES = ("qwen3_moe", "mixtral", "gpt_oss")
FAMILY_NAMES = DENSE_FAMILY_NAMES + MOE_FAMILY_NAMES


def tiny_config(family: str, **overrides):
    """`family`'s tiny config; `overrides` replace its fields (a smaller model, other layer types)."""
    return _configs()[family](overrides)


def make_tiny_family(family: str, path: Path, *, seed: int = 0, **overrides) -> Path:
    """save_pretrained of a tiny random model of `family` (with `overrides`, tiny_config's)
    into `path`: deterministic."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:  # norms (w or 1 + w) and biases
                parameter.add_(torch.randn_like(parameter) * 0.3)
    model.save_pretrained(str(path))
    return path


def add_word_tokenizer(path: Path) -> Path:
    """A word-level tokenizer beside the checkpoint in `path`, so that text goes in and
    comes out: token i is the word "w<i>", 0..3 are pad, bos, eos and unk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, COMMON["vocab_size"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))
    return path
