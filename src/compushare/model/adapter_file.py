"""LoRA adapters in PEFT's format, read and written.

PEFT saves an adapter as a directory: `adapter_config.json` (peft_type LORA, r,
lora_alpha, target_modules, ...) beside `adapter_model.safetensors`, whose tensors
are named "base_model.model.model.layers.{i}.{module}.lora_A.weight". `save`
writes exactly that for a directory path; for a path ending in ".safetensors" it
writes one file, the same tensors with the config in the file's metadata. `load`
reads either, and also a PEFT directory saved with an adapter name
("...lora_A.default.weight").

An adapter made here names the model id it was trained on (metadata
"compushare_model_id"), and `load` refuses it for any other model. One trained by
PEFT names only `base_model_name_or_path`: it is taken for the model given when
its every factor fits that model's layers (a wrong base model of another shape is
refused; one of the very same shapes cannot be told apart).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import UsageError
from .lora import TARGET_MODULES, Adapter, LoraSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
MODEL_ID_KEY = "compushare_model_id"
CONFIG_KEY = "adapter_config"
# Options of PEFT's LoraConfig this reader does not implement: refused unless at their defaults.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "layers_to_transform": None,
                "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "lora_bias": False,
                "layer_replication": None, "target_parameters": None, "trainable_token_indices": None}


def peft_config(adapter: Adapter, base_model: str) -> dict:
    spec = adapter.spec
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "target_modules": list(spec.targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": spec.rslora,
            "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
            "base_model_name_or_path": base_model or None}


def save(adapter: Adapter, path: Path, *, base_model: str = "") -> Path:
    """Write `adapter` in PEFT's format: a directory, or one .safetensors file. Returns
    the path written. Written aside and renamed: a kill mid-write leaves the old file."""
    path = Path(path)
    tensors = {PEFT_PREFIX + name: t.detach().float().contiguous() for name, t in adapter.tensors.items()}
    config = peft_config(adapter, base_model)
    metadata = {"format": "pt", MODEL_ID_KEY: adapter.model_id}
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        save_file(tensors, str(partial), metadata=metadata | {CONFIG_KEY: json.dumps(config)})
        partial.replace(path)
        return path
    path.mkdir(parents=True, exist_ok=True)
    partial = path / (WEIGHTS_FILE + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    (path / (CONFIG_FILE + ".partial")).write_text(json.dumps(config, indent=2))
    partial.replace(path / WEIGHTS_FILE)
    (path / (CONFIG_FILE + ".partial")).replace(path / CONFIG_FILE)
    return path


def _spec(config: dict, where: Path) -> LoraSpec:
    if config.get("peft_type") != "LORA":
        raise UsageError(f"{where}: peft_type {config.get('peft_type')!r}: only LoRA adapters are supported")
    for key, default in _UNSUPPORTED.items():
        if config.get(key, default) not in (default, None, {}, False):
            raise UsageError(f"{where}: {key}={config[key]!r} is not supported (LoRA on whole projections only)")
    if config.get("bias", "none") != "none":
        raise UsageError(f"{where}: bias={config['bias']!r} is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise UsageError(f"{where}: target_modules must list projections among {sorted(TARGET_MODULES)}")
    try:
        return LoraSpec(int(config["r"]), float(config["lora_alpha"]), tuple(sorted(targets)),
                        bool(config.get("use_rslora", False)))
    except (KeyError, ValueError, TypeError, OverflowError) as exc:  # Overflow: JSON's unbounded integers
        raise UsageError(f"{where}: {exc}") from None


def _config(text: str, where: Path) -> dict:
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where}: the adapter config is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{where}: the adapter config is not a JSON object")
    return config


def _name(key: str) -> str:
    name = key.removeprefix(PEFT_PREFIX)
    return name.replace(".lora_A.default.weight", ".lora_A.weight").replace(".lora_B.default.weight",
                                                                          ".lora_B.weight")


def load(path: Path, *, model_id: str | None = None, config=None) -> Adapter:
    """The adapter at `path` (a PEFT directory or one .safetensors file). With
    `model_id`/`config`: refused (UsageError) unless made for that model and fitting it."""
    path = Path(path)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    if not weights.exists():
        raise UsageError(f"{path}: no adapter here (a PEFT directory or a .safetensors file)")
    try:
        with safe_open(str(weights), "pt") as f:
            metadata = f.metadata() or {}
            tensors = {_name(key): f.get_tensor(key).float() for key in f.keys()}
    except Exception as exc:  # not a safetensors file at all
        raise UsageError(f"{weights}: not a readable safetensors file ({exc})") from None
    if path.is_dir():
        try:
            peft = _config((path / CONFIG_FILE).read_text(), path)
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: no readable {CONFIG_FILE} ({exc})") from None
    elif CONFIG_KEY in metadata:
        peft = _config(metadata[CONFIG_KEY], path)
    elif (path.parent / CONFIG_FILE).exists():
        peft = _config((path.parent / CONFIG_FILE).read_text(), path)
    else:
        raise UsageError(f"{path}: no adapter config (metadata or {CONFIG_FILE} beside it)")
    spec = _spec(peft, path)
    named = metadata.get(MODEL_ID_KEY, "")
    if model_id is not None and named and named != model_id:
        raise UsageError(f"{path} was trained on model {named[:16]}…, not on {model_id[:16]}…: "
                         f"an adapter only applies to its own model")
    try:
        adapter = Adapter(spec, {name: t.contiguous() for name, t in tensors.items()}, named or model_id or "")
        if config is not None:
            adapter.check_fits(config)
    except ValueError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return adapter


def with_model(adapter: Adapter, model_id: str) -> Adapter:
    return Adapter(adapter.spec, adapter.tensors, model_id)


def zeros_like(adapter: Adapter) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in adapter.tensors.items()}


def model_id_of(path: Path) -> str | None:
    """The model id an adapter names (its file's metadata only, no tensors read), or
    None when it names none (a PEFT adapter). Raises when it is no adapter file."""
    path = Path(path)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    with safe_open(str(weights), "pt") as f:
        return (f.metadata() or {}).get(MODEL_ID_KEY) or None
