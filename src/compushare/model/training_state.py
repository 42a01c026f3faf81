"""A consumer's trainable state: its adapter's parameters, AdamW over them, the step
count, and checkpoints that resume exactly.

Used the same way by the swarm's training loop and the one-process reference:
gradients are computed elsewhere (remote spans, or one local graph), summed per
parameter in a fixed order, and `apply` takes one optimizer step. A checkpoint is
the adapter (PEFT's format, model/adapter_file.py), the optimizer's moments and a
small JSON of the step and settings: safetensors and JSON only, written aside and
renamed, so a kill at any moment leaves the previous checkpoint whole.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import UsageError
from . import adapter_file
from .lora import Adapter


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0


class TrainingState:
    def __init__(self, adapter: Adapter, settings: OptimizerSettings = OptimizerSettings(), *,
                 base_model: str = "") -> None:
        self.spec, self.model_id, self.base_model = adapter.spec, adapter.model_id, base_model
        self.params = {name: t.detach().clone().float().requires_grad_(True)
                       for name, t in sorted(adapter.tensors.items())}
        self.settings = settings
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=settings.lr, betas=settings.betas,
                                           eps=settings.eps, weight_decay=settings.weight_decay)
        self.step = 0

    def adapter(self) -> Adapter:
        """The current adapter (a snapshot: later steps do not change it)."""
        return Adapter(self.spec, {name: p.detach().clone() for name, p in self.params.items()}, self.model_id)

    def apply(self, grads: dict[str, torch.Tensor]) -> float:
        """One optimizer step with these gradients (every parameter's); the gradient
        norm before clipping."""
        missing = set(self.params) - set(grads)
        if missing:
            raise ValueError(f"no gradient for {sorted(missing)[:3]}")
        for name, param in self.params.items():
            param.grad = grads[name].to(param.dtype).clone()
        norm = torch.norm(torch.stack([p.grad.norm() for p in self.params.values()])).item()
        if self.settings.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.settings.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    # ------------------------------------------------------------ checkpoints

    def save(self, path: Path, extra: dict | None = None) -> None:
        """Checkpoint to `path` (a directory): adapter, moments, step and `extra` (the
        loop's settings, checked on resume)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        adapter_file.save(self.adapter(), path / "adapter.safetensors", base_model=self.base_model)
        moments = {}
        for name, param in self.params.items():
            state = self.optimizer.state.get(param, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    moments[f"{name}|{key}"] = state[key].contiguous()
            if "step" in state:
                moments[f"{name}|step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1)
        save_file(moments, str(path / "optimizer.safetensors.partial"))
        (path / "optimizer.safetensors.partial").replace(path / "optimizer.safetensors")
        meta = {"step": self.step, "spec": self.spec.to_wire(), "model_id": self.model_id,
                "optimizer": dataclasses.asdict(self.settings), "extra": extra or {}}
        (path / "state.json.partial").write_text(json.dumps(meta, indent=1))
        (path / "state.json.partial").replace(path / "state.json")  # last: it names a whole checkpoint

    @classmethod
    def resume(cls, path: Path, settings: OptimizerSettings, *, extra: dict | None = None,
               base_model: str = "") -> TrainingState | None:
        """The state a checkpoint at `path` holds (None: no checkpoint there). A
        checkpoint of other settings is refused: resuming it would not continue this run."""
        path = Path(path)
        if not (path / "state.json").exists():
            return None
        meta = json.loads((path / "state.json").read_text())
        if meta.get("extra", {}) != (extra or {}):
            raise UsageError(f"{path} is a checkpoint of another run ({meta.get('extra')}); remove it or choose "
                             f"another --out")
        adapter = adapter_file.load(path / "adapter.safetensors", model_id=meta["model_id"] or None)
        state = cls(adapter, settings, base_model=base_model)
        moments = load_file(str(path / "optimizer.safetensors"))
        for name, param in state.params.items():
            if f"{name}|exp_avg" in moments:
                state.optimizer.state[param] = {
                    "step": torch.tensor(float(moments[f"{name}|step"].item())),
                    "exp_avg": moments[f"{name}|exp_avg"].clone(), "exp_avg_sq": moments[f"{name}|exp_avg_sq"].clone()}
        state.step = int(meta["step"])
        return state
