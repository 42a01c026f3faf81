"""model/store.py: model id = content hash of the weights' description; the on-disk store."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compushare.errors import UsageError
from compushare.model.store import DESCRIPTION_FILE, ModelStore, describe, model_id_of
from helpers import make_tiny_llama

WEIGHTS = "model.safetensors"
SOME_TENSOR = "model.layers.2.mlp.down_proj.weight"


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def id_of(path: Path) -> str:
    return model_id_of(describe(path))


def edit_weights(path: Path, edit) -> None:
    tensors = load_file(str(path / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes, indent=2))


# ---------------------------------------------------------------- ids


def test_description_shape(tiny_model):
    desc = describe(tiny_model)
    assert desc["format"] == "compushare-model/1"
    assert desc["config"]["num_hidden_layers"] == 4
    assert "transformers_version" not in desc["config"] and "dtype" not in desc["config"]
    names = list(desc["tensors"])
    assert names == sorted(names)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert sum(n.startswith("model.layers.") for n in names) == 4 * 9
    entry = desc["tensors"][SOME_TENSOR]
    assert entry["dtype"] == "F32" and entry["shape"] == [64, 128] and entry["file"] == WEIGHTS
    assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])
    assert re.fullmatch(r"[0-9a-f]{64}", model_id_of(desc))


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
    before, after = describe(tiny_model), describe(edited)
    changed = [n for n in before["tensors"] if before["tensors"][n] != after["tensors"][n]]
    assert changed == [SOME_TENSOR]
    assert model_id_of(before) != model_id_of(after)


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
    assert {t["dtype"] for t in describe(edited)["tensors"].values()} == {"BF16"}


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
    desc = describe(sharded)
    assert {t["file"] for t in desc["tensors"].values()} == {"part-1.safetensors", "part-2.safetensors"}
    assert model_id_of(desc) == id_of(tiny_model)


def test_model_id_ignores_file_names_and_tensor_order(tiny_model):
    desc = describe(tiny_model)
    shuffled = desc | {"tensors": {n: t | {"file": "x"} for n, t in reversed(list(desc["tensors"].items()))}}
    assert model_id_of(shuffled) == model_id_of(desc)
    tweaked = json.loads(json.dumps(desc))
    tweaked["tensors"][SOME_TENSOR]["sha256"] = "0" * 64
    assert model_id_of(tweaked) != model_id_of(desc)


def test_describe_without_weights_raises_usage_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    with pytest.raises(UsageError, match="safetensors"):
        describe(tmp_path)


# ---------------------------------------------------------------- the store


def test_import_dir(tiny_model, tmp_path):
    store = ModelStore(tmp_path / "data")
    model = store.import_dir(tiny_model, alias="tiny")
    assert model.model_id == id_of(tiny_model)
    assert model.path == tmp_path / "data" / "models" / model.model_id
    assert json.loads((model.path / DESCRIPTION_FILE).read_text()) == describe(tiny_model) == model.description
    assert (model.path / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()
    assert (model.path / WEIGHTS).read_bytes() == (tiny_model / WEIGHTS).read_bytes()
    assert model.num_blocks == 4 and model.hidden_size == 64 and model.dtype == "float32"
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


def test_import_uses_a_given_description(tiny_model, tmp_path):
    store = ModelStore(tmp_path / "data")
    desc = describe(tiny_model)
    assert store.import_dir(tiny_model, description=desc).model_id == model_id_of(desc)


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
