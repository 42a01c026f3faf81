"""A run's outer state through the torrent layer: how a joiner gets the weights.

After each outer step every participant lays out the new outer weights, and the
outer optimizer's momentum buffer, as two stored models (a Hugging Face directory
imported into the store: content-addressed manifests, hash-verified pieces) and seeds
them. Participants computing the same outer step write the same bytes, so they seed
the same model ids. A joiner asks a few participants for the round's ids (`state`),
takes the answer most of them give, fetches both models from every seeder, and checks
the weights against the round's base digest before it uses them.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..model.store import ModelStore, StoredModel
from ..model.weights import read_tensors
from .inner import build_model, flat_params, load_flat
from .recipe import Recipe

KEEP_ROUNDS = 2  # earlier rounds of outer state a participant keeps seeding beside the current one


def weights_digest(flat: torch.Tensor) -> bytes:
    """The base digest: SHA-256 of the flat fp32 weights' little-endian bytes."""
    return hashlib.sha256(flat.detach().to(torch.float32).contiguous().numpy().tobytes()).digest()


def store_flat(store: ModelStore, recipe: Recipe, flat: torch.Tensor, model=None) -> StoredModel:
    """Lay `flat` out as a stored model (the model's own tensor names and config)."""
    model = model if model is not None else build_model(recipe)
    load_flat(model, flat)
    staging = Path(tempfile.mkdtemp(prefix=".diloco-", dir=store.root))
    try:
        model.config.to_json_file(staging / "config.json")
        # Parameters once each (a tied head is the embedding's), as the model names them.
        save_file({name: p.detach().contiguous() for name, p in model.named_parameters()},
                  str(staging / "model.safetensors"))
        return store.import_dir(staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_flat_from(stored: StoredModel, recipe: Recipe, model=None) -> torch.Tensor:
    """The flat vector of a stored (fetched) model of the recipe's shape."""
    model = model if model is not None else build_model(recipe)
    tensors = read_tensors(stored.path, lambda names: names)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or [name for name in missing if name != "lm_head.weight"]:
        raise ValueError(f"stored outer state does not fit the recipe: missing {missing}, unexpected {unexpected}")
    return flat_params(model)
