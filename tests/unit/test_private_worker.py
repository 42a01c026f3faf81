"""pipeline/server/private_worker.WorkerState, the HE worker process's pure request
handler, on real CKKS and the tiny Llama's blocks 0:2: keys are checked (digest,
every rotation the model's products need), requests outside the span refused, a
project round trip decrypts to the plaintext product, pre-encoded or not, in the
decode plan and the prompt plan, and two workers' shares add up to one worker's
answer byte for byte."""

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
TOKENS = 5  # more than a prompt plan's tokens a ciphertext: a full group and a partial one


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


def encrypt(secret, plan, x: np.ndarray) -> list[bytes]:
    """A request's input ciphertexts: per group of the plan's tokens, one a chunk."""
    return [secret.encrypt(slots) for start in range(0, len(x), plan.tokens)
            for slots in plan.input_slots(x[start:start + plan.tokens])]


def request(keys, layer: int, group: str, tokens: int, cts: list[bytes]) -> dict:
    return {"op": "project", "digest": keys_digest(keys), "layer": layer, "group": group, "tokens": tokens,
            "cts": cts}


def project(worker, secret, keys, config, layer: int, group: str, x: np.ndarray,
            cts: list[bytes] | None = None) -> tuple[np.ndarray, list]:
    plan = choose(*group_shapes(config)[group], secret.slots, len(x))
    cts = cts or encrypt(secret, plan, x)
    reply = worker.handle(request(keys, layer, group, len(x), cts))
    outs = [[data for _, data in group] for group in reply["parts"]]
    assert [[o for o, _ in group] for group in reply["parts"]] == [list(range(plan.outputs))] * plan.groups(len(x))
    assert reply["seconds"] >= 0
    product = plan.reduce(np.stack([secret.decrypt(ct) for out in outs for ct in out]), len(x))
    return product, outs


def relative(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("tokens", [1, TOKENS])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_a_project_round_trip_decrypts_to_the_plaintext_product(worker, secret, keys, config, weights, layer, group,
                                                                 tokens):
    x = inputs(config, group, seed=layer * 10 + len(group))[:tokens]
    product, _ = project(worker, secret, keys, config, layer, group, x)
    expected = x @ group_weight(weights, layer, group).T
    assert product.shape == expected.shape == (tokens, group_shapes(config)[group][0])
    assert relative(product, expected) <= 1e-5


def test_the_prompt_plan_packs_tokens_for_the_tiny_model(config, secret):
    plans = {group: choose(*shape, secret.slots, TOKENS) for group, shape in group_shapes(config).items()}
    assert any(plan.tokens > 1 for plan in plans.values())


@pytest.mark.parametrize("tokens", [1, TOKENS])
def test_two_workers_shares_add_up_to_one_workers_answer(tiny_model, worker, secret, keys, config, tokens):
    shares = []
    for index in range(2):
        state = WorkerState()
        state.handle(load_request(tiny_model, share=[index, 2]))
        state.handle({"op": "keys", "digest": keys_digest(keys), "data": keys})
        shares.append(state)
    assert sum(s.handle(load_request(tiny_model, share=[s.share[0], 2]))["plaintexts"] for s in shares) == \
        worker.handle(load_request(tiny_model))["plaintexts"]
    worker.handle({"op": "keys", "digest": keys_digest(keys), "data": keys})
    for group in sorted(GROUPS):
        x = inputs(config, group, seed=3)[:tokens]
        plan = choose(*group_shapes(config)[group], secret.slots, tokens)
        cts = encrypt(secret, plan, x)
        _, whole = project(worker, secret, keys, config, 1, group, x, cts)
        parts = [share.handle(request(keys, 1, group, tokens, cts))["parts"] for share in shares]
        for g in range(plan.groups(tokens)):
            for o in range(plan.outputs):
                pieces = [data for worker_parts in parts for at, data in worker_parts[g] if at == o]
                joined = pieces[0] if len(pieces) == 1 else shares[0].handle({"op": "add", "parts": [pieces]})["cts"][0]
                assert joined == whole[g][o]  # exact modular sums: the same ciphertext, byte for byte


def test_encoding_per_request_gives_the_same_product(tiny_model, worker, secret, keys, config):
    lazy = WorkerState()
    loaded = lazy.handle(load_request(tiny_model, preencode=False))
    assert loaded["preencoded"] is False and loaded["plaintexts"] == 0
    lazy.handle({"op": "keys", "digest": keys_digest(keys), "data": keys})
    for layer, group in [(0, "qkv"), (1, "down"), (1, "gate_up")]:
        x = inputs(config, group, seed=7)
        plan = choose(*group_shapes(config)[group], secret.slots, len(x))
        cts = encrypt(secret, plan, x)  # the same ciphertexts to both
        eager, eager_out = project(worker, secret, keys, config, layer, group, x, cts)
        per_request, lazy_out = project(lazy, secret, keys, config, layer, group, x, cts)
        assert lazy_out == eager_out  # the same plaintexts and operations: the same ciphertexts, byte for byte
        np.testing.assert_array_equal(per_request, eager)


def test_a_budget_too_small_for_the_encoded_weights_encodes_per_request(tiny_model):
    state = WorkerState()
    loaded = state.handle(load_request(tiny_model, budget_bytes=1))
    assert loaded["preencoded"] is False and loaded["preencode_bytes"] > 1
    assert all(isinstance(w, np.ndarray) for w in state.weights.values()) and not state.encoded


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
    cts = encrypt(secret, plan, np.ones((1, plan.cols)))
    for layer, group in [(2, "o"), (3, "qkv"), (-1, "o"), (0, "q_proj"), (0, "nope")]:
        with pytest.raises(HEError, match="not served"):
            worker.handle(request(keys, layer, group, 1, cts))


def test_unknown_keys_bad_ciphertexts_and_ops_are_heerrors(worker, secret, keys, config):
    plan = choose(*group_shapes(config)["o"], secret.slots, 2)
    good = encrypt(secret, plan, np.ones((2, plan.cols)))
    assert len(good) == 1  # the tiny model's o packs two tokens a ciphertext
    base = request(keys, 0, "o", 2, good)
    with pytest.raises(HEError, match="unknown keys"):
        worker.handle({**base, "digest": "ab" * 32})
    with pytest.raises(HEError, match="the plan takes 1"):
        worker.handle({**base, "cts": good * 2})  # more ciphertexts than the tokens' plan
    for bad in (good[0][:100], b"x" * 64, good[0][:8] + bytes(8) + good[0][16:]):
        with pytest.raises(HEError):
            worker.handle({**base, "tokens": 3, "cts": [good[0], bad]})  # all checked before any work
    wrong_input = worker.handle(base)["parts"][0][0][1]  # a product, sent back as an input
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
        state.handle(request(keys, 0, "o", 1, encrypt(secret, plan, np.ones((1, plan.cols)))))


def test_the_pool_joins_parts_in_frames_a_worker_accepts_and_checks_every_output(monkeypatch):
    """private_pool.HEWorker._join: parts to add go to worker 0 in calls of at most
    half a worker frame (8 workers' parts of a large request would pass the frame
    otherwise), and an answer missing one of the plan's outputs is an HEError."""
    import trio

    from compushare.pipeline.server import private_pool

    monkeypatch.setattr(private_pool, "MAX_WORKER_FRAME", 4000)
    pool = private_pool.HEWorker("unused", params=PARAMS, workers=2)
    calls = []

    async def call(request, timeout_s):
        calls.append(sum(len(d) for parts in request["parts"] for d in parts))
        return {"cts": [b"sum" + parts[0][:1] for parts in request["parts"]]}

    monkeypatch.setattr(pool.processes[0], "call", call)
    groups = 6  # both workers computed part of both outputs of every group: 1,820 bytes to add a group
    parts = [[[[0, bytes([g]) * 900], [1, b"x" * 10]] for g in range(groups)],
             [[[0, b"z" * 900], [1, b"y" * 10]] for _ in range(groups)]]
    out = trio.run(pool._join, parts, 2)
    assert len(calls) > 1 and max(calls) <= 2000  # several calls, each under half a frame
    assert out == [[b"sum" + bytes([g]), b"sumx"] for g in range(groups)]
    with pytest.raises(HEError, match="makes 3"):
        trio.run(pool._join, [[[[0, b"a"], [1, b"b"]]], [[]]], 3)  # the plan's third output missing


def test_the_pool_never_evicts_a_key_set_an_open_session_uses(monkeypatch):
    """private_pool.HEWorker.add_keys: past MAX_KEY_SETS the least recently used set
    goes, unless an open session uses it (`keep`): that one stays, the next goes."""
    import trio

    from compushare.pipeline.server import private_pool

    pool = private_pool.HEWorker("unused", params=PARAMS, workers=2)
    dropped = []

    async def call(request, timeout_s):
        if request["op"] == "drop":
            dropped.append(request["digest"])
        return {}

    for process in pool.processes:
        monkeypatch.setattr(process, "call", call)
        process.process, process.span = object(), (0, 2)  # loaded: no worker to start
    digests = [f"{i:064x}" for i in range(private_pool.MAX_KEY_SETS + 2)]

    async def main():
        for digest in digests:
            await pool.add_keys((0, 2), digest, b"k", keep={digests[0]})

    trio.run(main)
    assert pool.has_keys(digests[0]) and not pool.has_keys(digests[1]) and not pool.has_keys(digests[2])
    assert dropped == [digests[1]] * 2 + [digests[2]] * 2  # from both workers
    assert len([d for d in digests if pool.has_keys(d)]) == private_pool.MAX_KEY_SETS
