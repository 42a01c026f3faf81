"""GGUF files made by llama.cpp's own converter (tests/data/gguf, tools/family_ggufs.py),
one per family: `models import` keeps their tensors, reads the config llama.cpp would
run from the file's metadata, and serves what transformers computes from the checkpoint
the file was made from (rebuilt here from its seed): the f32 files hold that
checkpoint's values, so the logits are bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from compushare.errors import ModelUnavailable, UsageError
from compushare.model.blocks import SpanRunner, load_full_model
from compushare.model.catalog import import_path
from compushare.model.families import FAMILIES, family_of_config, head_spec, layer_types
from compushare.model.head import ConsumerHead
from compushare.proofs.inference import relative_error
from test_families import Split, generate, transformers_model
from tiny_families import make_tiny_family

DATA = Path(__file__).resolve().parents[1] / "data" / "gguf"
INDEX = json.loads((DATA / "fixtures.json").read_text())["files"]
F32 = sorted(name for name, entry in INDEX.items() if entry["outtype"] == "f32")
# What llama.cpp's converter cannot write, and so no file of it holds: Mistral is written
# as a "llama" file without its sliding window (llama.cpp runs it without one).
DROPPED = {"mistral": dict(architectures=["LlamaForCausalLM"], model_type="llama", sliding_window=None)}
# What llama.cpp computes otherwise than transformers: YaRN's correction range rounded out to
# whole dimensions (gpt-oss's own config says not to round; llama.cpp rounds for every file).
ROUNDED = {"gpt_oss": lambda config: config | {"rope_parameters": config["rope_parameters"] | {"truncate": True}}}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPUSHARE_CACHE", str(tmp_path / "cache"))


def checkpoint_of(name: str, directory: Path) -> Path:
    """The Hugging Face checkpoint fixture `name` was made from, rebuilt."""
    entry = INDEX[name]
    return make_tiny_family(entry["family"], directory / "hf", seed=entry["seed"], **entry["overrides"])


def head_size(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def rope(config: dict) -> dict:
    """Each layer type's rope parameters, as transformers reads them."""
    from transformers import AutoConfig

    parameters = AutoConfig.for_model(**config).rope_parameters
    return parameters if "rope_type" not in parameters else {"full_attention": parameters}


@pytest.mark.parametrize("name", F32)
def test_a_converted_file_serves_what_transformers_computes(name, tmp_path):
    family = INDEX[name]["family"]
    source = checkpoint_of(name, tmp_path)
    model = import_path(DATA / name, tmp_path / "data", alias=family)
    ours, theirs = model.manifest.config, json.loads((source / "config.json").read_text())
    theirs |= DROPPED.get(family, {})
    theirs = ROUNDED.get(family, lambda config: config)(theirs)
    assert family_of_config(ours) is family_of_config(theirs)
    assert layer_types(ours) == layer_types(theirs) and ours.get("sliding_window") == theirs.get("sliding_window")
    assert rope(ours) == rope(theirs)
    assert head_spec(ours) == head_spec(theirs)  # norms' eps, embedding scale, final soft-capping
    assert head_size(ours) == head_size(theirs)
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings",
                "attn_logit_softcapping", "query_pre_attn_scalar", "bos_token_id", "eos_token_id"):
        assert ours.get(key) == theirs.get(key), key
    # The same computation: spans and head bit-identical to transformers' whole model.
    if family in DROPPED or family in ROUNDED:
        (source / "config.json").write_text(json.dumps(theirs))
    reference = transformers_model(source)
    cache = __import__("transformers").DynamicCache(config=reference.config)

    @torch.inference_mode()
    def step(ids):
        return reference(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]

    expected, tokens = generate(step)
    spans = [(0, 1), (1, model.num_blocks)]
    if FAMILIES[family].moe:  # the file's 3-D experts run on ggml (mul_mat_id), not through transformers' modules
        with pytest.raises(ModelUnavailable, match="a quantized mixture of experts runs on ggml"):
            Split(model.path, spans)
        split = GgmlSplit(model.path, spans)
        got, served = generate(split.step)
        assert served == tokens
        errors = [relative_error(a.numpy(), b.numpy()) for a, b in zip(got, expected)]
        print(f"{family}: ggml against transformers, relative error at most {max(errors):.1e}")
        assert max(errors) <= MOE_GGML_TOLERANCE
        return
    split = Split(model.path, spans)
    got, served = generate(split.step)
    assert served == tokens
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max().item()}"


# A mixture of experts' f32 file on ggml against transformers' whole model: ggml's kernels
# and summation order, and llama.cpp's float16 KV cache. Measured over every step: at most
# 2.4e-3 (Mixtral), 3.1e-3 (Qwen3-MoE), 4.5e-3 (gpt-oss); the tokens are transformers' all
# the same, and llama.cpp's exactly (tests/slow/test_ggml_llamacpp.py).
MOE_GGML_TOLERANCE = 1e-2


class GgmlSplit(Split):
    """Split's head and spans, the spans on ggml."""

    def __init__(self, path, spans):
        from compushare.spans.ggml.load import load_ggml_span

        self.head = ConsumerHead.load(path)
        self.runners = [load_ggml_span(path, start, end) for start, end in spans]
        self.caches = [runner.new_cache() for runner in self.runners]
        self.length = 0


def test_a_q8_0_file_serves_gguf_pys_dequantization(tmp_path):
    """The converter's own Q8_0: each matrix stays Q8_0, and the model computes with
    gguf-py's dequantization of its blocks (within the int4 kernel's bfloat16 rounding)."""
    name = "tiny-qwen2-q8_0.gguf"
    model = import_path(DATA / name, tmp_path / "data", alias="q8")
    reader = {t.name: t for t in gguf.GGUFReader(str(DATA / name)).tensors}
    types = model.manifest.weights["types"]
    assert types["model.layers.1.mlp.down_proj.weight"] == "Q8_0" and set(types.values()) == {"Q8_0"}
    state = load_full_model(model.path).state_dict()  # dequantized as the kernels' reference
    raw = reader["blk.1.ffn_down.weight"]
    expected = gguf.quants.dequantize(np.asarray(raw.data), raw.tensor_type)
    assert np.array_equal(state["model.layers.1.mlp.down_proj.weight"].numpy(), expected)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(DATA), gguf_file=name, dtype=torch.float32).eval()
    runner, head = SpanRunner.load(model.path, 0, model.num_blocks), ConsumerHead.load(model.path)
    ids = [1, 17, 42, 99, 3, 200, 7]
    logits = head.logits_rows(runner.forward(head.embed_tokens(ids), runner.new_cache(), 0))
    with torch.no_grad():
        dequantized = reference(torch.tensor([ids])).logits[0]
        rounded = reference.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    # The int4 kernel holds each Q8_0 weight within bfloat16's rounding (test_gguf.py) and
    # its products' inputs and outputs in bfloat16: the logits are no further from the
    # dequantized model's than the same model's in bfloat16 are.
    # Measured: 1.5e-2 against the bfloat16 model's 1.9e-2.
    assert relative_error(logits.numpy(), dequantized.numpy()) <= relative_error(rounded.numpy(), dequantized.numpy())


def test_an_unsupported_architecture_is_refused_before_conversion(tmp_path, monkeypatch):
    """general.architecture is read first: a file no family serves is refused naming the
    families, before transformers reads it or anything is written to the cache."""
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((3, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from compushare.model import gguf_import

    def never(*_args, **_kwargs):
        raise AssertionError("converted before the architecture was checked")

    monkeypatch.setattr(gguf_import, "import_gguf_cached", never)
    for fmt in (None, "fp32"):
        with pytest.raises(UsageError, match="GGUF architecture gpt2") as refused:
            import_path(path, tmp_path / "data", alias="nope", fmt=fmt)
        assert all(family.title in str(refused.value) for family in FAMILIES.values())
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", ["tiny-mixtral-f32.gguf", "tiny-qwen3_moe-f32.gguf"])
@pytest.mark.parametrize("fmt", ["q4", "fp32"])
def test_a_moe_file_is_kept_as_it_comes(name, fmt, tmp_path):
    """A mixture of experts' GGUF (a Mixtral's written as a "llama" file with experts) is
    not converted: its experts run on ggml as stored, and nothing is written."""
    with pytest.raises(UsageError, match="mixture of experts' GGUF file is kept as it comes"):
        import_path(DATA / name, tmp_path / "data", alias="moe", fmt=fmt)
    assert not (tmp_path / "cache").exists()
