"""ConsumerHead: the parts of a model a consumer keeps locally.

Torch only: a consumer never runs a decoder layer, so it does not import
transformers' modeling code (seconds of imports before a `run`'s first token).
What differs between families (Gemma's scaled embeddings, (1 + w) final norm and
soft-capped logits) is read off config.json through model/families.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import kernels
from .families import HeadSpec, head_spec, read_config
from .formats import base_name
from .weights import read_tensors

HEAD_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's and Qwen2's final RMSNorm, op for op as transformers runs it (same
    dtype casts, same order), so the logits match a single-process model's exactly."""
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def rms_norm_plus_one(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's final RMSNorm, scaling by (1 + w) in float32 before casting back, op
    for op as transformers runs it."""
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(hidden)


class ConsumerHead:
    def __init__(self, state: dict[str, torch.Tensor], spec: HeadSpec, dtype=torch.float32):
        self.dtype, self.spec, self.rms_norm_eps = dtype, spec, spec.rms_norm_eps
        self.quantized = any(name != base_name(name) for name in state)
        if self.quantized:  # int8 / q4 models: the embedding's rows dequantized, the LM head a kernel
            self.embed_parts = {name[len(EMBED):]: t for name, t in state.items() if base_name(name) == EMBED}
            head_parts = {name[len(LM_HEAD):]: t for name, t in state.items() if base_name(name) == LM_HEAD}
            self.lm_head_module = kernels.linear(head_parts or self.embed_parts)  # tied: SmolLM2
        else:
            self.embed = state[EMBED].to(dtype)
            # Tied models (SmolLM2) store no lm_head: the embedding matrix is reused.
            self.lm_head = state.get(LM_HEAD, self.embed).to(dtype)
        self.norm_weight = state["model.norm.weight"].to(dtype)

    @classmethod
    def load(cls, model_dir: Path, dtype=torch.float32) -> ConsumerHead:
        state = read_tensors(model_dir, lambda names: [n for n in names if base_name(n) in HEAD_TENSORS])
        return cls(state, head_spec(read_config(model_dir)), dtype)

    @torch.inference_mode()
    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        embedded = self._embed_rows(token_ids)
        if self.spec.embed_scale is not None:  # Gemma: scaled in the embedding's dtype, as transformers does
            embedded = embedded * torch.tensor(self.spec.embed_scale).to(embedded.dtype)
        return embedded

    def _embed_rows(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], dtype=torch.long)
        if self.quantized:
            return kernels.embedding_rows(self.embed_parts, ids, self.dtype)
        return torch.nn.functional.embedding(ids, self.embed)

    def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = rms_norm_plus_one if self.spec.norm_plus_one else rms_norm
        return norm(hidden.to(self.dtype), self.norm_weight, self.rms_norm_eps)

    def _project(self, rows: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head_module(rows) if self.quantized else rows @ self.lm_head.T
        cap = self.spec.final_softcap
        if cap is not None:  # Gemma 2's final soft-capping, in transformers' order
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every position of `hidden` [1, n, H]: [n, vocab] (a verify pass).
        One product for all rows: its rows may round differently from `logits`' one-row
        product (by ~1e-5 relative), which can only matter between near-tied tokens."""
        if hidden.shape[1] == 1:
            return self.logits(hidden).unsqueeze(0)
        rows = self._norm(hidden[0])
        return self._project(rows).float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the last position: [vocab]."""
        last = self._norm(hidden[:, -1:, :])
        return self._project(last)[0, -1].float()
