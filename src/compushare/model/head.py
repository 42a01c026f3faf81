"""ConsumerHead: the parts of a model a consumer keeps locally.

Torch only: a consumer never runs a decoder layer, so it does not import
transformers' modeling code (seconds of imports before a `run`'s first token).
What differs between families (Gemma's scaled embeddings, (1 + w) final norm and
soft-capped logits) is read off config.json through model/families.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import gguf_native, kernels
from .families import HeadSpec, head_spec, read_config
from .formats import base_name
from .manifest import parse
from .weights import read_tensors

HEAD_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
# (LM head matrix's raw blocks, its ggml type, final norm weight, spec) -> an object whose
# `logits(hidden float32 [n, H])` gives float32 [n, vocab], or None to decline.
LmHeadFactory = Callable[[torch.Tensor, str, torch.Tensor, HeadSpec], Any]
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


def stored_range(model_dir: Path, manifest, name: str) -> tuple[Path, int, tuple[int, ...]]:
    """(file, first byte, shape) of tensor `name` of the model stored in `model_dir`,
    from its manifest."""
    for entry in manifest.files:
        if name in entry.tensors:
            tensor = entry.tensors[name]
            return Path(model_dir) / entry.name, tensor.begin, tensor.shape
    raise ValueError(f"{model_dir} has no tensor {name}")


class ConsumerHead:
    def __init__(self, state: dict[str, torch.Tensor], spec: HeadSpec, dtype=torch.float32, *,
                 gguf_rows: gguf_native.MappedRows | None = None, gguf_types: dict[str, str] | None = None,
                 lm_head: LmHeadFactory | None = None):
        """`lm_head`: for a GGUF's own tensors, what computes the final norm and LM head
        instead of the type's torch kernel (spans.load_head gives ggml's, as llama.cpp
        computes them); it may decline (None)."""
        self.dtype, self.spec, self.rms_norm_eps = dtype, spec, spec.rms_norm_eps
        self.quantized = bool(gguf_types) or any(name != base_name(name) for name in state)
        self.gguf_rows = gguf_rows
        self.projector = None  # final norm, LM head and soft-cap computed elsewhere (`lm_head`)
        if gguf_types:  # a GGUF's own tensors: embedding rows read from the file, the LM head its type's kernel
            head = LM_HEAD if LM_HEAD in gguf_types else EMBED  # tied: the embedding's own blocks
            if lm_head is not None:
                self.projector = lm_head(state[head], gguf_types[head], state["model.norm.weight"], spec)
            # On torch's kernel now, or (ggml computing the logits) when training first asks.
            self._torch_head = lambda: kernels.linear({"": state[head]}, gguf_type=gguf_types[head])
            if self.projector is None:
                self.lm_head_module = self._torch_head()
        elif self.quantized:  # int8 / q4 models: the embedding's rows dequantized, the LM head a kernel
            self.embed_parts = {name[len(EMBED):]: t for name, t in state.items() if base_name(name) == EMBED}
            head_parts = {name[len(LM_HEAD):]: t for name, t in state.items() if base_name(name) == LM_HEAD}
            self.lm_head_module = kernels.linear(head_parts or self.embed_parts)  # tied: SmolLM2
        else:
            # In storage of their own: torch's float32 products round by the weights'
            # alignment, and a tensor read from a file sits at the file's offset.
            self.embed = kernels.aligned(state[EMBED].to(dtype))
            # Tied models (SmolLM2) store no lm_head: the embedding matrix is reused.
            self.lm_head = kernels.aligned(state.get(LM_HEAD, self.embed).to(dtype))
        self.norm_weight = state["model.norm.weight"].to(dtype)

    @classmethod
    def load(cls, model_dir: Path, dtype=torch.float32, *, lm_head: LmHeadFactory | None = None) -> ConsumerHead:
        path = Path(model_dir) / "manifest.json"
        manifest = parse(path.read_bytes()) if path.exists() else None
        types = dict(manifest.format.types) if manifest is not None else {}
        if types:  # the LM head read with plain reads (a mapping would stay resident), the embedding mapped
            state = read_tensors(model_dir, lambda names: [n for n in names if n == "model.norm.weight"])
            head = LM_HEAD if LM_HEAD in types else EMBED
            state[head] = torch.from_numpy(gguf_native.read_rows(*stored_range(model_dir, manifest, head)))
            rows = gguf_native.MappedRows(*stored_range(model_dir, manifest, EMBED), types[EMBED])
            return cls(state, head_spec(manifest.config), dtype, gguf_rows=rows, gguf_types=types, lm_head=lm_head)
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
        if self.gguf_rows is not None:
            return torch.from_numpy(self.gguf_rows(list(token_ids))).to(self.dtype).unsqueeze(0)
        if self.quantized:
            return kernels.embedding_rows(self.embed_parts, ids, self.dtype)
        return torch.nn.functional.embedding(ids, self.embed)

    def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = rms_norm_plus_one if self.spec.norm_plus_one else rms_norm
        return norm(hidden.to(self.dtype), self.norm_weight, self.rms_norm_eps)

    def _project(self, rows: torch.Tensor) -> torch.Tensor:
        if self.quantized and not hasattr(self, "lm_head_module"):  # training through a ggml-computed head
            self.lm_head_module = self._torch_head()
        logits = self.lm_head_module(rows) if self.quantized else rows @ self.lm_head.T
        cap = self.spec.final_softcap
        if cap is not None:  # Gemma 2's final soft-capping, in transformers' order
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _projected(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.projector.logits(rows.to(torch.float32).numpy()))  # soft-capped there

    @torch.inference_mode()
    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every position of `hidden` [1, n, H]: [n, vocab] (a verify pass).
        One product for all rows: its rows may round differently from `logits`' one-row
        product (by ~1e-5 relative), which can only matter between near-tied tokens."""
        if hidden.shape[1] == 1:
            return self.logits(hidden).unsqueeze(0)
        if self.projector is not None:
            return self._projected(hidden[0])
        rows = self._norm(hidden[0])
        return self._project(rows).float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the last position: [vocab]."""
        if self.projector is not None:
            return self._projected(hidden[0, -1:, :])[0]
        last = self._norm(hidden[:, -1:, :])
        return self._project(last)[0, -1].float()

