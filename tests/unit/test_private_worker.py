"""pipeline/server/private_worker.WorkerState, the HE worker process's pure request
handler, on real CKKS and the tiny Llama's blocks 0:2: keys are checked (digest,
every rotation the model's products need), requests outside the span refused, and
a project round trip decrypts to the plaintext product, pre-encoded or not."""

from __future__ import annotations

import numpy as np
import pytest

from compushare.he.ckks import HEError, SecretContext, keys_digest
from compushare.he.groups import GROUPS, group_shapes, group_weight, required_steps
from compushare.he.plan import choose
from compushare.model.arch import load_config
from compushare.model.weights import read_tensors
from compushare.pipeline.server.private_worker import WorkerState

pytestmark = pytest.mark.unit

PARAMS = "ckks-8192-60-40-60"
TOKENS = 2


def load_request(model_dir, **extra) -> dict:
    return {"op": "load", "model_dir": str(model_dir), "start": 0, "end": 2, "params": PARAMS, "preencode": True,
            **extra}


@pytest.fixture(scope="module")
def config(tiny_model):
    return load_config(tiny_model)


@pytest.fixture(scope="module")
def secret():
    return SecretContext(PARAMS)


@pytest.fixture(scope="module")
def keys(secret, config) -> bytes:
    return secret.galois_keys(required_steps(config, secret.slots))


@pytest.fixture(scope="module")
def weights(tiny_model):
    state = read_tensors(tiny_model, lambda names: [n for n in names if n.endswith("_proj.weight")])
    return {k: v.float().numpy() for k, v in state.items()}


@pytest.fixture(scope="module")
def worker(tiny_model, keys):
    """A worker holding blocks 0:2, pre-encoded, with the consumer's keys."""
    state = WorkerState()
    loaded = state.handle(load_request(tiny_model))
    assert loaded["plaintexts"] > 0 and loaded["preencoded"] is True
    assert state.handle({"op": "keys", "digest": keys_digest(keys), "data": keys}) == {"bytes": len(keys)}
    return state


def inputs(config, group: str, seed: int) -> np.ndarray:
    """Token rows for a group's product. Scaled up (x100): CKKS's error is absolute
    (~1e-5, test_he_ckks.py), and the tiny model's weights are small, so unit inputs
    would measure the noise floor rather than the round trip."""
    rows, cols = group_shapes(config)[group]
    return 100 * np.random.default_rng(seed).normal(0, 1, (TOKENS, cols))


def project(worker, secret, keys, config, layer: int, group: str, x: np.ndarray,
            cts: list[bytes] | None = None) -> tuple[np.ndarray, list]:
    plan = choose(*group_shapes(config)[group], secret.slots)
    cts = cts or [secret.encrypt(plan.input_slots(row)) for row in x]
    reply = worker.handle({"op": "project", "digest": keys_digest(keys), "layer": layer, "group": group, "cts": cts})
    assert len(reply["cts"]) == len(x) and all(len(out) == plan.outputs for out in reply["cts"])
    assert reply["seconds"] >= 0
    product = np.stack([plan.reduce(np.stack([secret.decrypt(ct) for ct in out])) for out in reply["cts"]])
    return product, reply["cts"]


def relative(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_a_project_round_trip_decrypts_to_the_plaintext_product(worker, secret, keys, config, weights, layer, group):
    x = inputs(config, group, seed=layer * 10 + len(group))
    product, _ = project(worker, secret, keys, config, layer, group, x)
    expected = x @ group_weight(weights, layer, group).T
    assert product.shape == expected.shape == (TOKENS, group_shapes(config)[group][0])
    assert relative(product, expected) <= 1e-5


def test_encoding_per_request_gives_the_same_product(tiny_model, worker, secret, keys, config):
    lazy = WorkerState()
    loaded = lazy.handle(load_request(tiny_model, preencode=False))
    assert loaded["preencoded"] is False and loaded["plaintexts"] == 0
    lazy.handle({"op": "keys", "digest": keys_digest(keys), "data": keys})
    for layer, group in [(0, "qkv"), (1, "down"), (1, "gate_up")]:
        x = inputs(config, group, seed=7)
        plan = choose(*group_shapes(config)[group], secret.slots)
        cts = [secret.encrypt(plan.input_slots(row)) for row in x]  # the same ciphertexts to both
        eager, eager_out = project(worker, secret, keys, config, layer, group, x, cts)
        per_request, lazy_out = project(lazy, secret, keys, config, layer, group, x, cts)
        assert lazy_out == eager_out  # the same plaintexts and operations: the same ciphertexts, byte for byte
        np.testing.assert_array_equal(per_request, eager)


def test_a_budget_too_small_for_the_encoded_weights_encodes_per_request(tiny_model):
    state = WorkerState()
    loaded = state.handle(load_request(tiny_model, budget_bytes=1))
    assert loaded["preencoded"] is False and loaded["preencode_bytes"] > 1
    assert all(isinstance(w, np.ndarray) for w in state.weights.values())


def test_keys_with_a_wrong_digest_are_refused(tiny_model, keys):
    state = WorkerState()
    with pytest.raises(HEError, match="no span"):
        state.handle({"op": "keys", "digest": keys_digest(keys), "data": keys})  # nothing loaded yet
    state.handle(load_request(tiny_model))
    for digest in ("0" * 64, keys_digest(keys + b"x"), keys_digest(keys).upper()):
        with pytest.raises(HEError, match="digest"):
            state.handle({"op": "keys", "digest": digest, "data": keys})
    assert not state.keys


def test_keys_lacking_a_rotation_are_refused(tiny_model, secret, config):
    state = WorkerState()
    state.handle(load_request(tiny_model))
    steps = sorted(required_steps(config, secret.slots))
    assert len(steps) >= 2
    missing = steps[-1]
    partial = secret.galois_keys(set(steps) - {missing})
    with pytest.raises(HEError, match=rf"lack rotations \[{missing}\]"):
        state.handle({"op": "keys", "digest": keys_digest(partial), "data": partial})
    none = secret.galois_keys(set())
    with pytest.raises(HEError, match="lack rotations"):
        state.handle({"op": "keys", "digest": keys_digest(none), "data": none})
    assert not state.keys


def test_requests_outside_the_span_are_refused(worker, secret, keys, config):
    plan = choose(*group_shapes(config)["o"], secret.slots)
    ct = secret.encrypt(plan.input_slots(np.ones(plan.cols)))
    for layer, group in [(2, "o"), (3, "qkv"), (-1, "o"), (0, "q_proj"), (0, "nope")]:
        with pytest.raises(HEError, match="not served"):
            worker.handle({"op": "project", "digest": keys_digest(keys), "layer": layer, "group": group, "cts": [ct]})


def test_unknown_keys_bad_ciphertexts_and_ops_are_heerrors(worker, secret, keys, config):
    plan = choose(*group_shapes(config)["o"], secret.slots)
    good = secret.encrypt(plan.input_slots(np.ones(plan.cols)))
    base = {"op": "project", "digest": keys_digest(keys), "layer": 0, "group": "o"}
    with pytest.raises(HEError, match="unknown keys"):
        worker.handle({**base, "digest": "ab" * 32, "cts": [good]})
    for bad in (good[:100], b"x" * 64, good[:8] + bytes(8) + good[16:]):
        with pytest.raises(HEError):
            worker.handle({**base, "cts": [good, bad]})  # all checked before any work
    wrong_input = worker.handle({**base, "cts": [good]})["cts"][0][0]  # a product, sent back as an input
    with pytest.raises(HEError, match="level"):
        worker.handle({**base, "cts": [wrong_input]})
    with pytest.raises(HEError, match="unknown op"):
        worker.handle({"op": "compute"})


def test_dropped_keys_are_gone(tiny_model, secret, keys, config):
    state = WorkerState()
    state.handle(load_request(tiny_model))
    digest = keys_digest(keys)
    state.handle({"op": "keys", "digest": digest, "data": keys})
    assert state.handle({"op": "drop", "digest": digest}) == {}
    plan = choose(*group_shapes(config)["o"], secret.slots)
    with pytest.raises(HEError, match="unknown keys"):
        state.handle({"op": "project", "digest": digest, "layer": 0, "group": "o",
                      "cts": [secret.encrypt(plan.input_slots(np.ones(plan.cols)))]})
