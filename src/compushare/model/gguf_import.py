"""Import a GGUF file as it comes (the `gguf` weight format), streaming tensor by tensor.

Nothing loads the whole model: the config and tokenizer come from the file's
metadata (transformers' GGUF readers, the config completed by gguf_config.py), the
tensors' names, types and byte ranges from gguf-py's GGUFReader, and each tensor's
bytes are read with a plain file read when layout.lay_out writes it, so memory holds
one tensor at a time (a page-cache mapping of the whole file would count in the
process's RSS as it is read).

Tensor names map to transformers' names through transformers' own GGUF map
(`get_gguf_hf_weights_map`, over gguf-py's per-architecture name tables), built on a
meta-device model of the file's config. Every 2-D tensor is kept as its raw blocks
(U8 [out, row bytes]); Llama-architecture files store attn_q / attn_k rows permuted
for llama.cpp's rotary layout, and those rows are put back as transformers puts
them back (rows are whole blocks, so this is exact). 1-D tensors (norms, biases)
are stored as float32 values after transformers' own per-architecture processing,
looked up under the file's general.architecture (Gemma's norms, which the file holds
as 1 + w, stored as w).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import ModelUnavailable, UsageError
from . import gguf_config, gguf_native
from .formats import GGUF_TYPES, WeightFormat
from .layout import LAYOUT_VERSION, ConvertedTensors, StoredSpec, lay_out
from .manifest import Manifest

log = logging.getLogger(__name__)


DERIVED_TENSORS = {"rope_freqs.weight"}  # read into the config, not stored


class GGUFTensors:
    """layout.lay_out's tensor source for a GGUF file: specs from the metadata, bytes on
    demand. `names` maps GGUF tensor names to stored ones; `heads` gives the head count
    of each GGUF tensor whose rows are stored permuted."""

    def __init__(self, path: Path, names: dict[str, str], heads: dict[str, int], processor) -> None:
        import gguf

        self.path, self.processor = path, processor
        self.specs_by_name: dict[str, StoredSpec] = {}
        self.types: dict[str, str] = {}
        self._where: dict[str, tuple[str, str, int, int, tuple[int, ...]]] = {}
        self.skipped: list[str] = []
        for tensor in gguf.GGUFReader(str(path)).tensors:
            stored = names.get(tensor.name)
            if stored is None:
                # Llama 3.x's rope_freqs is read into the config's rope scaling (gguf_config).
                # Anything else unmapped (LongRoPE factors, say) would change the
                # computation: serving without it would be silently wrong.
                if tensor.name not in DERIVED_TENSORS:
                    raise UsageError(f"{path.name}: tensor {tensor.name} has no place in the model as CompuShare "
                                     "runs it; refusing the file rather than serving it without that tensor")
                self.skipped.append(tensor.name)
                continue
            kind = tensor.tensor_type.name
            dims = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists the fastest axis first
            if len(dims) in (2, 3):  # a matrix, or a mixture's experts' matrices [experts, out, in]
                if kind not in GGUF_TYPES:
                    raise UsageError(f"{path.name}: {tensor.name} is of ggml type {kind}, which no node reads")
                if len(dims) == 3 and not stored.endswith(EXPERT_MATRICES):
                    raise UsageError(f"{path.name}: {tensor.name} has 3 dimensions")
                spec = StoredSpec("U8", (*dims[:-1], gguf_native.row_bytes(kind, dims[-1])))
                self.types[stored] = kind
            elif len(dims) == 1:
                spec = StoredSpec("F32", dims)
            else:
                raise UsageError(f"{path.name}: {tensor.name} has {len(dims)} dimensions")
            if spec.nbytes != int(tensor.n_bytes) and len(dims) >= 2:
                raise UsageError(f"{path.name}: {tensor.name} holds {tensor.n_bytes} bytes, not {spec.nbytes}")
            self.specs_by_name[stored] = spec
            self._where[stored] = (tensor.name, kind, int(tensor.data_offset), int(tensor.n_bytes), dims)
        self.heads = {names[name]: count for name, count in heads.items() if name in names}
        missing = sorted(set(names.values()) - set(self.specs_by_name) - {"lm_head.weight"})
        if missing:
            raise UsageError(f"{path.name} lacks tensors the model needs: {', '.join(missing[:4])}")

    def specs(self) -> dict[str, StoredSpec]:
        return self.specs_by_name

    def read(self, name: str):
        gguf_name, kind, offset, size, dims = self._where[name]
        try:
            raw = gguf_native.read_rows(self.path, offset, (size,))
        except ValueError:
            raise UsageError(f"{self.path.name} ends inside tensor {gguf_name}") from None
        if len(dims) >= 2:
            rows = raw.reshape(*dims[:-1], -1)
            return gguf_native.unpermute(rows, self.heads[name]) if name in self.heads else rows
        values = gguf_native.dequantize(raw.reshape(1, -1), kind).reshape(-1)
        values = self.processor.process(weights=values, name=gguf_name).weights
        return np.ascontiguousarray(values, dtype=np.float32)

    def converted(self, fmt: WeightFormat) -> ConvertedTensors:
        """These tensors converted to `fmt` (fp32, bf16, int8, q4) as each is read: a
        matrix's blocks dequantized as gguf-py does, then quantized, one at a time."""
        import torch

        def value(name: str) -> torch.Tensor:
            data = self.read(name)
            kind = self.types.get(name)
            return torch.from_numpy(gguf_native.dequantize(data, kind) if kind is not None else data)

        shapes = {name: ("F32", self._where[name][4]) for name in self.specs_by_name}
        return ConvertedTensors(shapes, value, fmt, self.path.name)


def read_metadata(path: Path, staging: Path):
    """The file's config (as transformers reads it, checked servable) and tokenizer,
    written into `staging`; returns (config, GGUF architecture name)."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .arch import architecture_of

    fields, rope_freqs, tensor_names = gguf_config.read_fields(path)
    architecture = fields["general.architecture"]  # gguf-py's, which transformers may rename (gemma3_text)
    if gguf_config.moe_model_type(architecture, fields) is not None:  # read off the metadata alone
        completed = gguf_config.completed(gguf_config.moe_base_config(fields), fields, rope_freqs, tensor_names)
        config = AutoConfig.for_model(**completed)
    else:
        try:
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        except (ValueError, KeyError, NotImplementedError) as exc:
            raise UsageError(f"{path.name}: transformers cannot read this GGUF file's model ({exc})") from None
        if not getattr(config, "architectures", None) and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config = type(config).from_dict(gguf_config.completed(config.to_dict(), fields, rope_freqs, tensor_names))
    try:
        architecture_of(config)  # refused here, before anything is stored
    except ModelUnavailable as exc:
        raise UsageError(f"{path.name}: no node could serve it: {exc}") from None
    config.save_pretrained(str(staging))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except TypeError:
        # transformers' GGUF reader fails on a gpt-oss file's YaRN keys while choosing the
        # tokenizer's class from the config; the vocabulary itself converts as for any file.
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(staging))
    return config, architecture


# A mixture of experts' block tensors: GGUF suffix -> stored name. transformers' GGUF map
# has no names for their experts (it loads them into 3-D gate_up parameters); the store
# keeps the file's own 3-D tensors [experts, out, row bytes] as they are, for ggml, whose
# expert products (mul_mat_id) take them so. The router is "gate" in Qwen3-MoE and
# Mixtral, "router" in gpt-oss.
MOE_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_norm.weight": "post_attention_layernorm.weight",  # the MoE's input norm
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # gpt-oss's name for it
    "ffn_gate_inp.weight": "mlp.{router}.weight", "ffn_gate_inp.bias": "mlp.{router}.bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj", "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias", "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
MOE_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}
EXPERT_MATRICES = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")


def moe_tensor_names(path: Path, config, gguf_architecture: str):
    """tensor_names for a mixture of experts: the file's tensors under MOE_BLOCK_NAMES
    (UsageError for one it cannot place); a Mixtral's q / k rows are stored permuted,
    as a Llama's."""
    import gguf

    router = "router" if config.model_type == "gpt_oss" else "gate"
    names, heads = {}, {}
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.name in MOE_GLOBAL_NAMES:
            names[tensor.name] = MOE_GLOBAL_NAMES[tensor.name]
            continue
        parts = tensor.name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in MOE_BLOCK_NAMES:
            names[tensor.name] = f"model.layers.{parts[1]}.{MOE_BLOCK_NAMES[parts[2]].format(router=router)}"
            if gguf_architecture == "llama" and parts[2] in ("attn_q.weight", "attn_k.weight"):
                heads[tensor.name] = config.num_attention_heads if parts[2] == "attn_q.weight" else kv_heads
    expected = {f"model.layers.{i}.{name}" for i in range(config.num_hidden_layers)
                for name in (*EXPERT_MATRICES, f"mlp.{router}.weight", "input_layernorm.weight",
                             "post_attention_layernorm.weight", "self_attn.o_proj.weight")}
    missing = sorted(expected - set(names.values()))
    if missing:
        raise UsageError(f"{path.name} lacks tensors a mixture of experts needs: {', '.join(missing[:4])}")
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    return names, heads, TensorProcessor(config=config.to_dict())


def tensor_names(config, gguf_architecture: str):
    """({GGUF name: transformers name}, {GGUF name: heads} of permuted rows, processor)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, Gemma2TensorProcessor,
                                                          LlamaTensorProcessor, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    processor_class = TENSOR_PROCESSORS.get(gguf_architecture, TensorProcessor)
    # Only processors that leave matrices alone (or permute whole rows) keep raw blocks exact.
    if processor_class not in (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor):
        raise UsageError(f"GGUF architecture {gguf_architecture} rewrites its matrices on load: not kept as stored")
    processor = processor_class(config=config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        names = get_gguf_hf_weights_map(model, processor)
    except NotImplementedError as exc:
        raise UsageError(f"gguf-py has no tensor names for {gguf_architecture}: {exc}") from None
    names = {gguf_name: hf for gguf_name, hf in names.items() if hf in model.state_dict()}
    heads = {}
    if processor_class is LlamaTensorProcessor:
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        for gguf_name in names:
            if ".attn_q." in gguf_name:
                heads[gguf_name] = config.num_attention_heads
            elif ".attn_k." in gguf_name:
                heads[gguf_name] = kv_heads
    return names, heads, processor


def import_gguf(path: Path, target: Path, *, fmt: WeightFormat | None = None,
                progress: Callable[[int, int], None] | None = None,
                on_stage: Callable[[str], None] = lambda _stage: None) -> Manifest:
    """Lay the GGUF file `path` out at `target` (a new directory) in the gguf format,
    or converted to `fmt` (still a tensor at a time)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path} is not a file")
    staging = Path(tempfile.mkdtemp(prefix=".gguf-meta-", dir=target.parent))
    try:
        on_stage("reading the metadata of")
        config, architecture = read_metadata(path, staging)
        if config.model_type in gguf_config.MOE_MODEL_TYPES.values():
            names, heads, processor = moe_tensor_names(path, config, architecture)
        else:
            names, heads, processor = tensor_names(config, architecture)
        tensors = GGUFTensors(path, names, heads, processor)
        if tensors.skipped:
            log.info("%s: not used by transformers' model: %s", path.name, ", ".join(tensors.skipped))
        kinds = ", ".join(sorted(set(tensors.types.values())))
        if fmt is not None:
            log.info("%s: converting its tensors (%s) to %s", path.name, kinds, fmt.label)
            on_stage("converting")
            return lay_out(staging, target, progress=progress, fmt=fmt, tensors=tensors.converted(fmt))
        log.info("%s: keeping its tensors as they are (%s)", path.name, kinds)
        on_stage("writing")
        kept = WeightFormat("gguf", types=tuple(sorted(tensors.types.items())))
        return lay_out(staging, target, progress=progress, fmt=kept, tensors=tensors)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def import_gguf_cached(path: Path, cache_dir: Path, *, fmt: WeightFormat | None = None, progress=None,
                       on_stage=lambda _stage: None) -> Path:
    """The file laid out once (per format) into the shared conversion cache (under a
    lock: nodes starting together lay it out once), for the store to hard-link; a file
    rewritten in place (another mtime) is laid out afresh."""
    import hashlib

    from .sources import file_lock
    from .store import MANIFEST_FILE

    stat = Path(path).stat()
    kept = "kept" if fmt is None else fmt.label.replace("/", "-")
    digest = hashlib.sha256(f"{Path(path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / "converted" / f"gguf-{kept}-v{LAYOUT_VERSION}-{digest}"
    with file_lock(cache_dir / "locks" / f"gguf-{kept}-{digest}.lock"):
        if not (target / MANIFEST_FILE).exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            laid_out = Path(tempfile.mkdtemp(prefix=".layout-", dir=target.parent))
            try:
                import_gguf(path, laid_out, fmt=fmt, progress=progress, on_stage=on_stage)
                shutil.rmtree(target, ignore_errors=True)
                os.replace(laid_out, target)
            finally:
                shutil.rmtree(laid_out, ignore_errors=True)
    return target
