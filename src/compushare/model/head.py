"""ConsumerHead: the parts of a model a consumer keeps locally."""

from __future__ import annotations

from pathlib import Path

import torch

from .arch import architecture_of, load_config
from .blocks import read_tensors

HEAD_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


class ConsumerHead:
    def __init__(self, config, state: dict[str, torch.Tensor], dtype=torch.float32):
        self.config, self.dtype = config, dtype
        self.embed = state["model.embed_tokens.weight"].to(dtype)
        # Tied models (SmolLM2) store no lm_head: the embedding matrix is reused.
        self.lm_head = state.get("lm_head.weight", self.embed).to(dtype)
        self.norm = architecture_of(config).norm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm.load_state_dict({"weight": state["model.norm.weight"].to(dtype)})
        self.norm.to(dtype).eval()

    @classmethod
    def load(cls, model_dir: Path, dtype=torch.float32) -> ConsumerHead:
        config = load_config(model_dir)
        state = read_tensors(model_dir, lambda names: [n for n in names if n in HEAD_TENSORS])
        return cls(config, state, dtype)

    @torch.inference_mode()
    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], dtype=torch.long)
        return torch.nn.functional.embedding(ids, self.embed)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the last position: [vocab]."""
        last = self.norm(hidden[:, -1:, :].to(self.dtype))
        return (last @ self.lm_head.T)[0, -1].float()
