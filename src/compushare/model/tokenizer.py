"""A stored model's tokenizer: loading it, its end-of-sequence ids, a prompt encoded."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError


def encode_prompt(tokenizer, prompt: str | list[int], chat_template: bool = True) -> list[int]:
    """Token ids of `prompt`: ids as they are; text through the model's chat template
    (one user turn, the assistant's turn opened) where it has one and `chat_template`."""
    if isinstance(prompt, list):
        return list(prompt)
    if chat_template and tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])
    return tokenizer.encode(prompt)


# What AutoTokenizer resolves these to is transformers' generic fast tokenizer: loading
# that class directly skips AutoTokenizer's class tables and what they import (the
# modeling stack, torch._dynamo), seconds before a `run`'s first token.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(model_path: Path) -> str | None:
    try:
        return json.loads((model_path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None  # AutoTokenizer reports what is wrong


def load_tokenizer(model):
    """The tokenizer stored beside a model (a StoredModel)."""
    try:
        if _tokenizer_class(model.path) in GENERIC_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(model.path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model.path))
    except (OSError, ValueError) as exc:
        raise UsageError(f"model {model.model_id[:12]} has no usable tokenizer, so a text prompt cannot be "
                         f"encoded ({str(exc).splitlines()[0]})") from None


def eos_ids_of(tokenizer, model_path: Path) -> frozenset[int]:
    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return frozenset(ids)
