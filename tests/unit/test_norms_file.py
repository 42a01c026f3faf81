"""The norms file (manifest.NORMS_FILE, written by model/layout.py): every block's
tensors but its weight matrices, the bytes the block files hold, a few kB for the tiny
model; a private-mode consumer holding only the head, the tokenizer and it runs every
layer (model/private_layers.py) as one holding every block does, and fetches nothing
else (pipeline/client/consumer.private_fetch); a model laid out before the file
falls back to fetching every block."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open

from compushare.he.groups import GROUPS, group_weight
from compushare.model.formats import parse_format
from compushare.model.layout import lay_out
from compushare.model.manifest import NORMS_FILE, Manifest
from compushare.model.private_layers import PrivateLayers
from compushare.model.store import ModelStore
from compushare.model.weights import read_tensors
from compushare.pipeline.client import consumer as consumer_module
from compushare.pipeline.client.consumer import Consumer, private_fetch
from tiny_families import make_tiny_family

pytestmark = pytest.mark.unit

TINY_NORMS_BYTES = 4 * 2 * 64 * 4  # 4 layers, 2 norms of 64 float32 each


def file_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def block_tensors(laid) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(laid.glob("block-*.safetensors")):
        out |= file_tensors(path)
    return out


@pytest.fixture(scope="module")
def laid(tiny_model, tmp_path_factory):
    target = tmp_path_factory.mktemp("laid") / "m"
    return target, lay_out(tiny_model, target)


def test_the_norms_file_holds_each_blocks_small_tensors_and_nothing_else(laid):
    target, manifest = laid
    entry = manifest.files[manifest.norms_file]
    assert (entry.name, entry.role) == (NORMS_FILE, "meta")
    norms = file_tensors(target / NORMS_FILE)
    blocks = block_tensors(target)
    assert set(norms) == {n for n in blocks if not n.endswith("_proj.weight")}
    assert sorted({n.split(".", 3)[3] for n in norms}) == ["input_layernorm.weight", "post_attention_layernorm.weight"]
    assert all(torch.equal(norms[n], blocks[n]) for n in norms)  # the block files' very values
    # A few kB: the norms' bytes and a header; the manifest's tensor entries say where each is.
    assert TINY_NORMS_BYTES < entry.size < TINY_NORMS_BYTES + 2048
    assert (target / NORMS_FILE).stat().st_size == entry.size
    assert sum(t.end - t.begin for t in entry.tensors.values()) == TINY_NORMS_BYTES
    # With the head (a meta file): what every consumer fetches; a provider's span does not.
    assert manifest.norms_file in manifest.files_for(head=True)
    assert manifest.norms_file not in manifest.files_for(blocks=(0, manifest.num_blocks))


def test_biases_come_too_and_quantized_matrices_stay_out(tmp_path):
    """Qwen2's q/k/v biases are the consumer's (it adds them after decrypting); a q4
    model's matrices (with their scale and min parts) are not."""
    source = make_tiny_family("qwen2", tmp_path / "hf")
    lay_out(source, tmp_path / "q4", fmt=parse_format("q4"))
    norms = file_tensors(tmp_path / "q4" / NORMS_FILE)
    assert {n.split(".", 3)[3] for n in norms} == {
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    assert all(t.dtype == torch.float32 for t in norms.values())


def test_a_stored_model_lays_out_as_its_directory_again(laid, tmp_path):
    """Derivations lay a stored model out anew (catalog._derive): the norms file is not
    read as a second copy of the blocks' tensors."""
    target, manifest = laid
    again = lay_out(target, tmp_path / "again")
    assert again.model_id == manifest.model_id


def plaintext_projections(model_dir):
    state = read_tensors(model_dir, lambda names: [n for n in names if n.endswith("_proj.weight")])
    weights = {(layer, group): torch.from_numpy(group_weight(state, layer, group))
               for layer in range(4) for group in GROUPS}
    return lambda layer, group, x: (x.double() @ weights[(layer, group)].T).to(x.dtype)


def head_and_norms_only(laid, data_dir, *, norms: bool = True):
    """A store holding the model as a private consumer fetches it: the manifest, the
    head, the meta files (the norms file if `norms`), no block."""
    target, manifest = laid
    model = ModelStore(data_dir).add_manifest(manifest)
    for index in manifest.files_for(head=True):
        name = manifest.files[index].name
        if norms or name != NORMS_FILE:
            shutil.copy(target / name, model.path / name)
    return model


def run(layers) -> torch.Tensor:
    hidden = torch.linspace(-1, 1, 3 * 64).reshape(1, 3, 64)
    return layers.forward(hidden, layers.new_cache(), 0)


def test_private_layers_run_from_the_head_and_the_norms_file_alone(laid, tiny_model, tmp_path):
    model = head_and_norms_only(laid, tmp_path / "data")
    assert model.held_blocks() == [] and model.holds(head=True)
    project = plaintext_projections(tiny_model)
    from_norms = PrivateLayers.load(model.path, project)
    from_blocks = PrivateLayers.load(tiny_model, project)  # a directory without the file: its block files
    assert torch.equal(run(from_norms), run(from_blocks))


def test_what_a_private_consumer_fetches(laid, tmp_path):
    target, manifest = laid
    held = head_and_norms_only(laid, tmp_path / "held")
    assert private_fetch(held) is None
    without = head_and_norms_only(laid, tmp_path / "without", norms=False)  # a head fetched before the file
    assert private_fetch(without) == {"head": True}
    # A manifest laid out before the norms file: every block, as before.
    old = Manifest(manifest.config, manifest.piece_size, [f for f in manifest.files if f.name != NORMS_FILE])
    stored = ModelStore(tmp_path / "old").add_manifest(old)
    assert private_fetch(stored) == {"blocks": (0, 4)}
    for entry in old.files:
        shutil.copy(target / entry.name, stored.path / entry.name)
    assert private_fetch(stored) is None


class FakeTorrent:
    """Torrent's fetch, from a laid-out directory instead of the swarm."""

    calls: list[dict] = []
    source = None

    def __init__(self, host, dht, data_dir) -> None:
        self.store = ModelStore(data_dir)

    async def fetch(self, model_id: str, *, progress=None, **wanted) -> None:
        FakeTorrent.calls.append(wanted)
        model = self.store.get(model_id)
        for index in model.missing_files(**wanted):
            shutil.copy(FakeTorrent.source / model.manifest.files[index].name, model.path)


async def test_private_preparation_fetches_only_the_norms_file(laid, tmp_path, monkeypatch):
    target, _manifest = laid
    model = head_and_norms_only(laid, tmp_path / "data", norms=False)
    monkeypatch.setattr(consumer_module, "Torrent", FakeTorrent)
    monkeypatch.setattr(FakeTorrent, "source", target)
    monkeypatch.setattr(FakeTorrent, "calls", [])
    consumer = Consumer(None, None, tmp_path / "data", model, None, None)
    await consumer._prepare_private()
    assert FakeTorrent.calls == [{"head": True}]
    assert (model.path / NORMS_FILE).is_file() and model.held_blocks() == []
    layers = consumer._private["layers"]
    assert len(layers.layers) == 4 and consumer._private["keys"]
    await consumer._prepare_private()  # once per consumer
    assert FakeTorrent.calls == [{"head": True}]
