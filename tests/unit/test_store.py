"""model/layout.py and model/store.py: model id = hash of the manifest; the on-disk store."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compushare.errors import UsageError
from compushare.model.layout import lay_out
from compushare.model.store import MANIFEST_FILE, ModelStore
from compushare.model.manifest import parse
from helpers import make_tiny_llama

WEIGHTS = "model.safetensors"
SOME_TENSOR = "model.layers.2.mlp.down_proj.weight"


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def manifest_of(path: Path, **kwargs):
    with tempfile.TemporaryDirectory() as out:
        return lay_out(path, Path(out) / "m", **kwargs)


def id_of(path: Path) -> str:
    return manifest_of(path).model_id


def edit_weights(path: Path, edit) -> None:
    tensors = load_file(str(path / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes, indent=2))


# ---------------------------------------------------------------- ids


def test_manifest_shape(tiny_model):
    manifest = manifest_of(tiny_model)
    assert parse(manifest.raw, expected_id=manifest.model_id).model_id == manifest.model_id
    doc = json.loads(manifest.raw)
    assert doc["format"] == "compushare-manifest/1"
    assert doc["config"]["num_hidden_layers"] == 4
    assert "transformers_version" not in doc["config"] and "dtype" not in doc["config"]
    assert manifest.piece_size == 16 * 1024  # the smallest automatic size, for a tiny model
    names = [f.name for f in manifest.files]
    assert names[:5] == ["head.safetensors"] + [f"block-{b:04d}.safetensors" for b in range(4)]
    assert [f.role for f in manifest.files[:5]] == ["head"] + ["block"] * 4
    head, block2 = manifest.files[0], manifest.files[3]
    assert set(head.tensors) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert len(block2.tensors) == 9 and all(n.startswith("model.layers.2.") for n in block2.tensors)
    entry = block2.tensors[SOME_TENSOR]
    assert entry.dtype == "F32" and entry.shape == (64, 128) and entry.end - entry.begin == 64 * 128 * 4
    assert all(re.fullmatch(r"[0-9a-f]{64}", p) for f in manifest.files for p in f.pieces)
    assert re.fullmatch(r"[0-9a-f]{64}", manifest.model_id)
    # Every piece says which tensors it holds, and every tensor is in some piece.
    covered = {t for i in range(len(manifest.pieces)) for t in manifest.tensors_in_piece(i)}
    assert covered == set(manifest.tensors())
    assert manifest.pieces_for(blocks=(2, 3)) == set(manifest.file_pieces(3))


def test_laid_out_files_are_plain_safetensors(tiny_model, tmp_path):
    manifest = lay_out(tiny_model, tmp_path / "out")
    original = load_file(str(tiny_model / WEIGHTS))
    regrouped = {}
    for f in manifest.files:
        if f.name.endswith(".safetensors"):
            regrouped |= load_file(str(tmp_path / "out" / f.name))
    assert set(regrouped) == set(original)
    assert all(torch.equal(regrouped[n], original[n]) for n in original)
    assert (tmp_path / "out" / "manifest.json").read_bytes() == manifest.raw


def test_same_weights_same_id(tiny_model, tmp_path):
    rebuilt = make_tiny_llama(tmp_path / "again", seed=0)  # an independent build of the same weights
    copied = copy_model(tiny_model, tmp_path / "copy")
    assert id_of(tiny_model) == id_of(rebuilt) == id_of(copied) == id_of(tiny_model)


def test_different_weights_different_id(tiny_model, other_tiny_model):
    assert id_of(tiny_model) != id_of(other_tiny_model)


def test_changing_one_weight_value_changes_the_id(tiny_model, tmp_path):
    edited = copy_model(tiny_model, tmp_path / "edited")

    def nudge(tensors):
        tensors[SOME_TENSOR][17, 3] += 1e-3

    edit_weights(edited, nudge)
    before, after = manifest_of(tiny_model), manifest_of(edited)
    changed = [f.name for f, g in zip(before.files, after.files, strict=True) if f.pieces != g.pieces]
    assert changed == ["block-0002.safetensors"]
    assert before.model_id != after.model_id


def to_bf16(tensors):
    for name in tensors:
        tensors[name] = tensors[name].to(torch.bfloat16)


def test_renaming_a_tensor_changes_the_id(tiny_model, tmp_path):
    edited = copy_model(tiny_model, tmp_path / "edited")
    edit_weights(edited, lambda t: t.__setitem__("model.norm.weight2", t.pop("model.norm.weight")))
    assert id_of(edited) != id_of(tiny_model)


def test_changing_the_dtype_changes_the_id(tiny_model, tmp_path):
    edited = copy_model(tiny_model, tmp_path / "edited")

    edit_weights(edited, to_bf16)
    assert id_of(edited) != id_of(tiny_model)
    assert {t.dtype for t in manifest_of(edited).tensors().values()} == {"BF16"}


def test_reshaping_a_tensor_changes_the_id(tiny_model, tmp_path):
    edited = copy_model(tiny_model, tmp_path / "edited")
    edit_weights(edited, lambda t: t.__setitem__(SOME_TENSOR, t[SOME_TENSOR].reshape(128, 64).contiguous()))
    assert id_of(edited) != id_of(tiny_model)  # same bytes, different shape


def test_config_changes_that_matter_change_the_id(tiny_model, tmp_path):
    edited = copy_model(tiny_model, tmp_path / "edited")
    edit_config(edited, rms_norm_eps=1e-5)
    assert id_of(edited) != id_of(tiny_model)


def test_volatile_config_keys_do_not_change_the_id(tiny_model, tmp_path):
    edited = copy_model(tiny_model, tmp_path / "edited")
    edit_config(edited, transformers_version="0.0.1", _name_or_path="/somewhere", torch_dtype="bfloat16",
                dtype="float16", use_cache=False)
    assert id_of(edited) == id_of(tiny_model)


def test_config_key_order_does_not_change_the_id(tiny_model, tmp_path):
    edited = copy_model(tiny_model, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps(dict(reversed(list(config.items())))))
    assert id_of(edited) == id_of(tiny_model)


def test_file_layout_does_not_change_the_id(tiny_model, tmp_path):
    renamed = copy_model(tiny_model, tmp_path / "renamed")
    (renamed / WEIGHTS).rename(renamed / "weights.safetensors")
    assert id_of(renamed) == id_of(tiny_model)

    sharded = copy_model(tiny_model, tmp_path / "sharded")
    tensors = load_file(str(sharded / WEIGHTS))
    (sharded / WEIGHTS).unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, str(sharded / "part-1.safetensors"), metadata={"format": "pt"})
    save_file({n: tensors[n] for n in names[1::2]}, str(sharded / "part-2.safetensors"), metadata={"format": "pt"})
    assert id_of(sharded) == id_of(tiny_model)


def test_piece_size_is_part_of_the_id(tiny_model):
    small, large = manifest_of(tiny_model, piece_size=16 * 1024), manifest_of(tiny_model, piece_size=64 * 1024)
    assert small.model_id != large.model_id and len(small.pieces) > len(large.pieces)


def test_lay_out_without_weights_raises_usage_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    with pytest.raises(UsageError, match="safetensors"):
        manifest_of(tmp_path)


# ---------------------------------------------------------------- the store


def test_import_dir(tiny_model, tmp_path):
    store = ModelStore(tmp_path / "data")
    model = store.import_dir(tiny_model, alias="tiny")
    assert model.model_id == id_of(tiny_model)
    assert model.path == tmp_path / "data" / "models" / model.model_id
    assert (model.path / MANIFEST_FILE).read_bytes() == manifest_of(tiny_model).raw == model.manifest.raw
    assert json.loads((model.path / "config.json").read_text()) == model.manifest.config
    assert model.num_blocks == 4 and model.hidden_size == 64 and model.dtype == "float32"
    assert model.holds(blocks=(0, 4), head=True) and model.held_blocks() == [0, 1, 2, 3]
    assert not list((tmp_path / "data" / "models").glob(".import-*"))  # no staging left behind


def test_aliases_resolve(tiny_model, other_tiny_model, tmp_path):
    store = ModelStore(tmp_path / "data")
    a = store.import_dir(tiny_model, alias="tiny")
    b = store.import_dir(other_tiny_model, alias="other")
    assert a.model_id != b.model_id
    assert store.get("tiny") == store.get(a.model_id) == a
    assert store.get("other") == b
    assert store.aliases() == {"tiny": a.model_id, "other": b.model_id}
    # Aliases persist, and an alias may be pointed elsewhere.
    again = ModelStore(tmp_path / "data")
    assert again.get("tiny") == a
    again.set_alias("tiny", b.model_id)
    assert ModelStore(tmp_path / "data").get("tiny") == b


def test_reimport_is_idempotent_and_adds_aliases(tiny_model, tmp_path):
    store = ModelStore(tmp_path / "data")
    first = store.import_dir(tiny_model, alias="one")
    copy = copy_model(tiny_model, tmp_path / "copy")
    second = store.import_dir(copy, alias="two")
    assert first == second
    listing = store.list()
    assert [(names, m.model_id) for names, m in listing] == [(["one", "two"], first.model_id)]
    assert len([p for p in store.root.iterdir() if p.is_dir()]) == 1


def test_import_without_alias(tiny_model, tmp_path):
    store = ModelStore(tmp_path / "data")
    model = store.import_dir(tiny_model)
    assert store.aliases() == {}
    assert store.list() == [([], model)]


def test_import_of_a_laid_out_directory_links_its_files(tiny_model, tmp_path):
    laid = tmp_path / "laid"
    manifest = lay_out(tiny_model, laid)
    model = ModelStore(tmp_path / "data").import_dir(laid, laid_out=True)
    assert model.model_id == manifest.model_id
    block = model.path / "block-0001.safetensors"
    assert block.stat().st_ino == (laid / "block-0001.safetensors").stat().st_ino


def test_a_model_known_only_by_its_manifest_holds_no_files(tiny_model, tmp_path):
    manifest = manifest_of(tiny_model)
    model = ModelStore(tmp_path / "data").add_manifest(manifest, alias="tiny")
    assert model.model_id == manifest.model_id and model.held_files() == set()
    assert model.missing_files(blocks=(1, 3)) == [2, 3]
    assert not model.holds(head=True)
    # A later full import fills the directory in.
    full = ModelStore(tmp_path / "data").import_dir(tiny_model)
    assert full == model and full.holds(blocks=(0, 4), head=True)


def test_unknown_names_are_none(tiny_model, tmp_path):
    store = ModelStore(tmp_path / "data")
    store.import_dir(tiny_model, alias="tiny")
    assert store.get("nope") is None
    assert store.get("0" * 64) is None
    assert store.get("../models") is None


def test_import_dir_without_config_raises_usage_error(tiny_model, tmp_path):
    broken = copy_model(tiny_model, tmp_path / "broken")
    (broken / "config.json").unlink()
    store = ModelStore(tmp_path / "data")
    with pytest.raises(UsageError, match="config.json"):
        store.import_dir(broken, alias="broken")
    with pytest.raises(UsageError):
        store.import_dir(tmp_path / "does-not-exist")
    assert store.aliases() == {} and store.list() == []


def test_import_dir_without_weights_raises_usage_error(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    store = ModelStore(tmp_path / "data")
    with pytest.raises(UsageError):
        store.import_dir(src, alias="x")
    assert store.aliases() == {}


def test_dtype_property(tiny_model, tmp_path):
    bf16 = copy_model(tiny_model, tmp_path / "bf16")

    edit_weights(bf16, to_bf16)
    mixed = copy_model(tiny_model, tmp_path / "mixed")
    edit_weights(mixed, lambda t: t.__setitem__(SOME_TENSOR, t[SOME_TENSOR].half()))
    store = ModelStore(tmp_path / "data")
    assert store.import_dir(bf16).dtype == "bfloat16"
    assert store.import_dir(mixed).dtype == "mixed"
