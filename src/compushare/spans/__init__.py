"""Span runtimes: what computes a span of decoder layers, behind one interface.

Two implement it:
- torch (model/blocks.py's SpanRunner): Hugging Face checkpoints and our own formats
  (fp32, bf16, int8, q4), exact against transformers; training, LoRA adapters and
  private mode run here only.
- ggml (spans/ggml/): a GGUF model's weights as stored in its file, computed by
  llama.cpp's own tensor library the way llama.cpp builds its graphs.

The server's session machine, scheduler, budgets and proofs see only `SpanCompute`.

  ggml/        the ggml runtime
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..errors import UsageError

TORCH, GGML, AUTO = "torch", "ggml", "auto"
RUNTIMES = (AUTO, TORCH, GGML)


class SpanCompute(Protocol):
    """What a server asks of a span, whichever runtime computes it."""

    runtime: str
    build: str  # the runtime and its build, as ads name it ("ggml/0.25.3:1f2e3d4c", "torch/2.13.0")
    config: Any
    start: int
    end: int
    dtype: Any  # the torch dtype hidden states come back in
    format_label: str
    weight_bytes: int
    slowdown: float
    batchable: bool

    @property
    def hidden_size(self) -> int: ...

    def parameter_count(self) -> int: ...

    def new_cache(self) -> Any: ...

    def cached_length(self, cache: Any) -> int: ...

    def truncate(self, cache: Any, length: int) -> None: ...

    def forward(self, hidden, cache, position: int, start: int | None = None, end: int | None = None, *,
                between_layers: Callable[[], None] | None = None, adapter=None): ...


def runtime_for(model_dir: Path, requested: str = AUTO, device: str = "cpu") -> str:
    """The runtime that serves a stored model: a GGUF model on ggml (on CPU), anything
    else on torch; `requested` overrides, where it can serve the model."""
    from ..model.store import MANIFEST_FILE, stored_format

    if requested not in RUNTIMES:
        raise UsageError(f"unknown runtime {requested!r}: one of {', '.join(RUNTIMES)}")
    stored = stored_format(model_dir).name if (Path(model_dir) / MANIFEST_FILE).exists() else "safetensors"
    gguf = stored == "gguf"
    if requested == GGML and not gguf:
        raise UsageError(f"the ggml runtime serves GGUF models (imported with --format gguf); this one is stored as "
                         f"{stored}: serve it with --runtime torch")
    if requested == AUTO:
        return GGML if gguf and device == "cpu" and ggml_available() else TORCH
    return requested


def ggml_available() -> bool:
    try:
        from .ggml import lib  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def load_span(model_dir: Path, start: int, end: int, *, runtime: str = AUTO, device: str = "cpu",
              threads: int = 1) -> SpanCompute:
    """Load blocks start:end of the model stored in `model_dir` on its runtime."""
    chosen = runtime_for(model_dir, runtime, device)
    if chosen == TORCH:
        from ..model.blocks import SpanRunner

        return SpanRunner.load(model_dir, start, end, device=device)
    from .ggml.load import load_ggml_span

    return load_ggml_span(model_dir, start, end, threads=threads)


def load_head(model_dir: Path, *, runtime: str = AUTO):
    """The consumer's head of a stored model: a GGUF's LM head on ggml (as llama.cpp
    computes it, at the file's bytes) unless `runtime` is torch or ggml is missing."""
    from ..model.head import ConsumerHead

    if runtime == TORCH or not ggml_available():
        return ConsumerHead.load(model_dir)
    from .ggml.head import lm_head_on_ggml

    return ConsumerHead.load(model_dir, lm_head=lm_head_on_ggml)
