"""GGUF files as they come (the gguf format): per ggml type, the weights a kernel
computes with are gguf-py's dequantization of the file's blocks within the kernel's
rounding; a mixed (Q4_K_M-style) file imports without a whole-model load into what
transformers loads from it; layout streams and stays byte-deterministic."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from safetensors.torch import load_file
from hypothesis import strategies as st

from compushare.errors import UsageError
from compushare.model import gguf_native, kernels
from compushare.model.blocks import SpanRunner, load_full_model
from compushare.model.catalog import import_path
from compushare.model.head import ConsumerHead
from compushare.model.layout import PieceHasher, piece_hashes
from compushare.proofs.inference import relative_error
from gguf_files import Q4_K_M, raw_rows, write_tiny_llama

# type -> (kernel class, relative rounding of the served weights). The int4 kernel holds
# each weight of a symmetric type (Q4_0, Q5_0, Q8_0) as bfloat16 would hold it, within
# 2^-8 |w|, and of a type with a min within 2^-8 (|w| + 2^(bits - 1) |scale|)
# (kernels.int4_planes); its product comes out in bfloat16, 2^-8 more. Q6_K is held in
# float16 (2^-11); F16, BF16 and F32 exactly.
SERVED = {"Q4_0": ("GroupedInt4Linear", 2.0 ** -8), "Q4_1": ("GroupedInt4Linear", 2.0 ** -8),
          "Q5_0": ("GroupedInt4Linear", 2.0 ** -8), "Q5_1": ("GroupedInt4Linear", 2.0 ** -8),
          "Q8_0": ("GroupedInt4Linear", 2.0 ** -8), "Q4_K": ("GroupedInt4Linear", 2.0 ** -8),
          "Q5_K": ("GroupedInt4Linear", 2.0 ** -8), "Q6_K": ("DenseLinear", 2.0 ** -11),
          "F16": ("DenseLinear", 0.0), "BF16": ("DenseLinear", 0.0), "F32": ("DenseLinear", 0.0)}
SYMMETRIC = {"Q4_0", "Q5_0", "Q8_0"}
ROWS, COLS = 208, 512  # 208 rows: a packed chunk of 128 (the byte shuffle) and one of 80 (torch's converter)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Imports lay GGUF files out in the conversion cache: a test's own, not the repo's."""
    monkeypatch.setenv("COMPUSHARE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    """One GGUF file holding a [ROWS, COLS] matrix of every type, as GGUFWriter writes it."""
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama")
    for kind in SERVED:
        writer.add_tensor(kind, raw_rows(kind, ROWS, COLS, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def held_weights(module: kernels.GroupedInt4Linear, raw: np.ndarray, kind: str) -> np.ndarray:
    """The weights a GroupedInt4Linear computes with, decoded from what it holds (its
    packed codes checked against the codes they came from): float64 [rows, in]."""
    codes, scale, minimum = (torch.from_numpy(a) for a in gguf_native.affine_groups(raw, kind))
    codes, scales_and_zeros = kernels.int4_planes(codes, scale, minimum, module.planes)
    assert torch.equal(module.packed, kernels.pack_int4(codes))
    assert torch.equal(module.scales_and_zeros, scales_and_zeros)
    per_group = scales_and_zeros.double().repeat_interleave(32, dim=0).transpose(0, 1)  # [rows, in * planes, 2]
    values = (codes.double() - 8) * per_group[..., 0] + per_group[..., 1]
    return values.reshape(raw.shape[0], module.planes, -1).sum(dim=1).numpy()


@pytest.mark.parametrize("kind", sorted(SERVED))
def test_each_type_serves_the_files_dequantized_values(typed_file, kind, monkeypatch):
    monkeypatch.setattr(kernels.GroupedInt4Linear, "ROWS_AT_ONCE", 128)
    path, tensors = typed_file
    tensor = tensors[kind]
    raw = np.asarray(tensor.data).view(np.uint8).reshape(ROWS, -1)  # F16 etc. come typed
    expected = gguf.quants.dequantize(raw, tensor.tensor_type).astype(np.float64)
    module = kernels.linear({"": torch.from_numpy(raw.copy())}, gguf_type=kind)
    kernel, rounding = SERVED[kind]
    assert type(module).__name__ == kernel and module.in_features == COLS
    served = module(torch.eye(COLS)).T.double().numpy()  # the identity is exact in bfloat16: the weights themselves
    if kernel == "GroupedInt4Linear":
        held = held_weights(module, raw, kind)
        scale = np.repeat(np.abs(gguf_native.affine_groups(raw, kind)[1]), 32, axis=1)
        spread = 0 if kind in SYMMETRIC else 2 ** (gguf_native.AFFINE_BITS[kind] - 1) * scale
        assert np.all(np.abs(held - expected) <= rounding * (np.abs(expected) + spread))
        assert np.all(np.abs(served - held) <= rounding * np.abs(held))  # the product's bfloat16 output
    else:
        assert np.all(np.abs(served - expected) <= rounding * np.abs(expected))
    # The consumer's embedding: rows read from the mapped file, dequantized exactly.
    rows = gguf_native.MappedRows(path, int(tensor.data_offset), raw.shape, kind)
    assert np.array_equal(rows([5, 0, ROWS - 1, 5]), expected[[5, 0, ROWS - 1, 5]].astype(np.float32))
    # A product of several rows computes with the same weights.
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(0))
    assert relative_error(module(x).numpy(), (x.numpy() @ expected.T)) < 1e-2


def test_affine_groups_are_the_values(typed_file):
    """What the int4 kernel is given (codes, scale, min per 32) reconstructs gguf-py's values exactly."""
    _, tensors = typed_file
    for kind in gguf_native.AFFINE_BITS:
        tensor = tensors[kind]
        raw = np.asarray(tensor.data).view(np.uint8).reshape(ROWS, -1)  # F16 etc. come typed
        codes, scale, minimum = gguf_native.affine_groups(raw, kind)
        assert codes.max() < 2 ** gguf_native.AFFINE_BITS[kind]
        values = codes.astype(np.float32) * np.repeat(scale, 32, 1) + np.repeat(minimum, 32, 1)
        expected = gguf.quants.dequantize(raw, tensor.tensor_type)
        assert np.allclose(values, expected, rtol=1e-6, atol=1e-7), kind  # float32 rounding of gguf-py's order


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(1, 64), max_size=12), st.sampled_from([16, 64, 128]))
def test_pieces_hashed_as_written_equal_pieces_of_the_whole(data, cuts, piece_size):
    hasher, at = PieceHasher(piece_size), 0
    for cut in cuts + [len(data)]:
        hasher.update(data[at:at + cut])
        at += cut
    hasher.update(data[at:])
    assert hasher.finish() == piece_hashes(data, piece_size)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("mixed") / "tiny-q4_k_m.gguf", Q4_K_M)


def test_a_mixed_file_keeps_its_mix_and_is_what_transformers_loads(mixed_file, tmp_path):
    from transformers import AutoModelForCausalLM

    model = import_path(mixed_file, tmp_path / "a", alias="tiny")
    assert model.format.label == "gguf" and model.manifest.weights["format"] == "gguf"
    types = model.manifest.weights["types"]
    assert types["model.embed_tokens.weight"] == "Q8_0" and types["lm_head.weight"] == "Q6_K"
    assert {types[f"model.layers.2.{p}.weight"] for p in ("self_attn.v_proj", "mlp.down_proj")} == {"Q6_K"}
    assert types["model.layers.2.self_attn.q_proj.weight"] == "Q4_K" and len(types) == 2 + 4 * 7
    tensors = model.manifest.tensors()
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == "U8"  # the file's blocks
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == "F32"
    # Dequantized, the stored tensors are transformers' own GGUF load (names, unpermuted rows, values).
    reference = AutoModelForCausalLM.from_pretrained(str(mixed_file.parent), gguf_file=mixed_file.name,
                                                     dtype=torch.float32).eval()
    ours, theirs = load_full_model(model.path).state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # Served: each matrix on its type's kernel, the embedding's rows exact.
    runner, head = SpanRunner.load(model.path, 0, 4), ConsumerHead.load(model.path)
    attn, mlp = runner.layers[1].self_attn, runner.layers[1].mlp
    assert runner.format_label == "gguf" and isinstance(attn.q_proj, kernels.GroupedInt4Linear)
    assert isinstance(attn.v_proj, kernels.DenseLinear) and isinstance(mlp.gate_up_proj, kernels.GroupedInt4Linear)
    ids = [1, 5, 9, 13, 200]
    assert torch.equal(head.embed_tokens(ids)[0], theirs["model.embed_tokens.weight"][ids])
    logits = head.logits_rows(runner.forward(head.embed_tokens(ids), runner.new_cache(), 0))
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert relative_error(logits.numpy(), expected.numpy()) < 2e-2  # bfloat16 activations (TOLERANCES["gguf"])
    # Byte-deterministic: the same file gives the same id; the budget counts kernels' bytes.
    assert import_path(mixed_file, tmp_path / "b", alias="tiny").model_id == model.model_id
    assert model.block_bytes == max(sum(t.numel() * t.element_size() for t in layer.buffers()) + sum(
        p.numel() * p.element_size() for p in layer.parameters()) for layer in runner.layers.values())


def test_a_gguf_file_converted_to_another_format_streams(mixed_file, tmp_path, monkeypatch):
    """`--format fp32 | q4` on a GGUF: its tensors dequantized and converted one at a time
    (no whole-model load): fp32 holds exactly what the kept blocks dequantize to, q4 is
    our quantizer's conversion of those values, and a rewritten file is converted afresh."""
    from transformers import AutoModelForCausalLM

    from compushare.model.quantize import quantize

    kept = load_full_model(import_path(mixed_file, tmp_path / "kept", alias="tiny").path).state_dict()

    def whole_model(*_args, **_kwargs):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", whole_model)
    fp32 = import_path(mixed_file, tmp_path / "fp32", alias="tiny", fmt="fp32")
    assert fp32.format.label == "fp32" and fp32.manifest.weights is None
    ours = load_full_model(fp32.path).state_dict()
    assert ours.keys() == kept.keys() and all(torch.equal(ours[k], kept[k]) for k in kept)
    q4 = import_path(mixed_file, tmp_path / "q4", alias="tiny", fmt="q4")
    assert q4.format.label == "q4/g64" and q4.model_id not in (fp32.model_id,)
    name = "model.layers.2.mlp.gate_proj.weight"
    stored = load_file(q4.path / "block-0002.safetensors")
    expected = quantize(q4.format, name, kept[name])
    assert all(torch.equal(stored[k], expected[k]) for k in expected)
    runner, head = SpanRunner.load(q4.path, 0, 4), ConsumerHead.load(q4.path)
    assert runner.format_label == "q4/g64"
    logits = head.logits_rows(runner.forward(head.embed_tokens([1, 5, 9]), runner.new_cache(), 0))
    assert torch.isfinite(logits).all()
    # The cache is keyed by the file's size and mtime: a file rewritten in place is read again.
    copy = write_tiny_llama(tmp_path / "copy.gguf", Q4_K_M)
    first = import_path(copy, tmp_path / "first", alias="copy", fmt="fp32")
    write_tiny_llama(copy, Q4_K_M, seed=1)
    assert import_path(copy, tmp_path / "again", alias="copy", fmt="fp32").model_id != first.model_id


def test_a_tied_qwen2_file_imports_with_its_biases(tmp_path):
    """Qwen2: q / k / v biases, rows not permuted; tied: the LM head is the embedding's blocks."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_llama(tmp_path / "qwen2.gguf", Q4_K_M | {"token_embd": "Q4_K"}, arch="qwen2", tie=True)
    model = import_path(path, tmp_path / "store", alias="qwen")
    assert model.manifest.config["model_type"] == "qwen2" and "lm_head.weight" not in model.manifest.tensors()
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ours, theirs = load_full_model(model.path).state_dict(), reference.state_dict()
    assert "model.layers.0.self_attn.q_proj.bias" in ours
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    runner, head = SpanRunner.load(model.path, 0, 4), ConsumerHead.load(model.path)
    assert isinstance(head.lm_head_module, kernels.GroupedInt4Linear)  # the Q4_K embedding, as a kernel
    ids = [3, 30, 100]
    logits = head.logits_rows(runner.forward(head.embed_tokens(ids), runner.new_cache(), 0))
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert relative_error(logits.numpy(), expected.numpy()) < 2e-2


def test_an_architecture_no_node_serves_is_refused_before_storing(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    for key, value in (("context_length", 64), ("embedding_length", 32), ("block_count", 1),
                       ("feed_forward_length", 64), ("attention.head_count", 2)):
        writer.add_uint32(f"gpt2.{key}", value)
    writer.add_float32("gpt2.attention.layer_norm_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UsageError, match="gpt2|GPT2"):
        import_path(path, tmp_path / "store", alias="nope")
    assert not [p for p in (tmp_path / "store" / "models").iterdir() if p.name != "aliases.json"]


def test_a_manifest_names_gguf_types(mixed_file, tmp_path):
    from compushare.errors import FrameError
    from compushare.model.manifest import parse

    model = import_path(mixed_file, tmp_path, alias="tiny")
    raw = model.manifest.raw.decode()
    assert parse(model.manifest.raw, expected_id=model.model_id).format == model.format
    for old, new in (('"Q6_K"', '"Q7_K"'), ('"Q6_K"', '6'), ('"types":{', '"types":{"x":"Q4_0",'),
                     ('"format":"gguf"', '"format":"gguf","group_size":32')):
        with pytest.raises(FrameError):
            parse(raw.replace(old, new, 1).encode())
    assert json.loads(raw)["weights"]["types"] == dict(model.format.types)


def test_a_tensor_with_no_place_in_the_model_refuses_the_file(tmp_path):
    """Phi-3-128k's LongRoPE factors, say: served without them, the logits would be wrong."""
    path = write_tiny_llama(tmp_path / "extra.gguf", Q4_K_M, extra={"rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(UsageError, match="rope_factors_long.weight"):
        import_path(path, tmp_path / "store", alias="nope")
    assert not [p for p in (tmp_path / "store" / "models").iterdir() if p.name != "aliases.json"]
