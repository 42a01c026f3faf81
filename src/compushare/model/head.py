"""ConsumerHead: the parts of a model a consumer keeps locally.

Torch only: a consumer never runs a decoder layer, so it does not import
transformers' modeling code (seconds of imports before a `run`'s first token).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import kernels
from .arch import final_norm_eps
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


class ConsumerHead:
    def __init__(self, state: dict[str, torch.Tensor], rms_norm_eps: float, dtype=torch.float32):
        self.dtype, self.rms_norm_eps = dtype, rms_norm_eps
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
        return cls(state, final_norm_eps(model_dir), dtype)

    @torch.inference_mode()
    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], dtype=torch.long)
        if self.quantized:
            return kernels.embedding_rows(self.embed_parts, ids, self.dtype)
        return torch.nn.functional.embedding(ids, self.embed)

    def _project(self, rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head_module(rows) if self.quantized else rows @ self.lm_head.T

    @torch.inference_mode()
    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every position of `hidden` [1, n, H]: [n, vocab] (a verify pass).
        One product for all rows: its rows may round differently from `logits`' one-row
        product (by ~1e-5 relative), which can only matter between near-tied tokens."""
        if hidden.shape[1] == 1:
            return self.logits(hidden).unsqueeze(0)
        rows = rms_norm(hidden[0].to(self.dtype), self.norm_weight, self.rms_norm_eps)
        return self._project(rows).float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the last position: [vocab]."""
        last = rms_norm(hidden[:, -1:, :].to(self.dtype), self.norm_weight, self.rms_norm_eps)
        return self._project(last)[0, -1].float()
