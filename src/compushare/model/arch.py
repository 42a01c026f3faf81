"""A family's transformers classes (model/families.py names them), and configs loaded for them."""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Callable

from .families import Family, family_of_config, read_config


@dataclasses.dataclass(frozen=True)
class Architecture:
    family: Family
    decoder_layer: type
    rotary: type
    norm: type
    eager_attention: Callable  # the module's own attention function (Gemma 2's soft-caps its scores)
    apply_rotary: Callable


def architecture_of(config) -> Architecture:
    """The family's classes; ModelUnavailable naming the supported families if none fits."""
    family = family_of_config(config)
    module = importlib.import_module(family.module)
    return Architecture(family, getattr(module, f"{family.prefix}DecoderLayer"),
                        getattr(module, f"{family.prefix}RotaryEmbedding"), getattr(module, f"{family.prefix}RMSNorm"),
                        module.eager_attention_forward, module.apply_rotary_pos_emb)


def config_fields(model_dir) -> types.SimpleNamespace:
    """config.json's fields as attributes, read without transformers (importing it costs
    a process some 100 MB): what the ggml runtime reads, its recipe the same as from
    load_config's object for every family (tests/unit/test_ggml_spans.py)."""
    return types.SimpleNamespace(**read_config(model_dir))


def load_config(model_dir):
    """Config with the family's attention implementation set: standalone layers built
    from a config otherwise get none, and run a silently non-causal prefill."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    config._attn_implementation = family_of_config(config).attention
    return config
