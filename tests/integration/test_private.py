"""Private mode through real node processes: providers compute on CKKS ciphertexts."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from compushare.he.ckks import ParameterSet, SecretContext
from compushare.he.groups import group_shapes, group_weight, required_steps
from compushare.he.plan import choose
from compushare.karma.record import karma_validators
from compushare.karma.service import karma_of
from compushare.model.arch import load_config
from compushare.model.catalog import import_path
from compushare.model.store import ModelStore
from compushare.model.weights import read_tensors
from compushare.net.dial import dial
from compushare.net.framing import FramedStream
from compushare.net.peer import open_swarm_host
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
from compushare.pipeline.private_wire import KEYS_CHUNK, MAX_FRAME_BYTES, PRIVATE_PROTOCOL
from compushare.proofs.private import PrivateFailureReport
from helpers import dashboard, reference_greedy, wait_until

pytestmark = pytest.mark.integration


async def test_private_generation_through_three_providers_equals_plaintext(processes, tiny_model, tmp_path):
    states = processes.nodes([("a", "0:2")], tiny_model)
    boot = states[0]["addrs"][:1]
    states += processes.nodes([("b", "2:3"), ("c", "3:4")], tiny_model, bootstrap=boot)
    # The client holds nothing: it fetches the head with the norms file (every layer's
    # norms, manifest.NORMS_FILE) from the providers, and no block.
    client, model_id = tmp_path / "client", states[0]["model_id"]
    # 21 prompt tokens: a prefill pipelined over the 3 hops in chunks of 12.
    prompt, new = [1, 9, 8, 7, 6, 40, 41, 42, 43, 44, 45, 46, 47, 48, 200, 201, 202, 203, 204, 205, 206], 10
    outcome = await run_prompt(client, tuple(boot), RunRequest(
        model=model_id, prompt=prompt, private=True, params=SamplingParams(max_new_tokens=new, stop_at_eos=False)),
        spot_check_rate=0.0)
    assert outcome.tokens == reference_greedy(tiny_model, prompt, new)
    fetched = ModelStore(client).get(model_id)
    assert fetched.holds(head=True) and fetched.held_blocks() == []
    assert fetched.manifest.norms_file in fetched.held_files()
    assert [(h.start, h.end) for h in outcome.route] == [(0, 2), (2, 3), (3, 4)]
    assert [h.peer_id for h in outcome.route] == [s["peer_id"] for s in states]
    steps_tokens = len(prompt) + new - 1  # the last token is sampled, never run
    assert outcome.private["projections"] == 7 * 4 * steps_tokens  # no layer in plaintext
    assert outcome.private["keys_sent"] == 3


def _encrypt(secret, plan, x) -> list[bytes]:
    """A request's input ciphertexts (x: [tokens, cols]): per group of the plan's
    tokens, one a chunk."""
    return [secret.encrypt(slots) for start in range(0, len(x), plan.tokens)
            for slots in plan.input_slots(x[start:start + plan.tokens])]


def _decrypt(secret, plan, tokens, reply) -> np.ndarray:
    """[tokens, rows] from a projected reply: its cts are one list of outputs per group."""
    assert reply["type"] == "projected", reply
    assert [len(group) for group in reply["cts"]] == [plan.outputs] * plan.groups(tokens)
    return plan.reduce(np.stack([secret.decrypt(ct) for group in reply["cts"] for ct in group]), tokens)


class _Answers:
    """A private stream whose receive skips the provider's `busy` frames (2.1.0: said
    every 10 s while it works, e.g. pre-encoding its span on a loaded machine)."""

    def __init__(self, framed: FramedStream) -> None:
        self.framed = framed

    async def send(self, message: dict) -> None:
        await self.framed.send(message)

    async def receive(self):
        while (message := await self.framed.receive()) is not None and message.get("type") == "busy":
            pass
        return message

    async def close(self) -> None:
        await self.framed.close()


async def _session(host, state, model_id, secret, keys, *, start=0, end=2, params=None):
    info = await dial(host, state["peer_id"], state["addrs"], timeout=10)
    framed = _Answers(FramedStream(await host.new_stream(info.peer_id, [PRIVATE_PROTOCOL]), MAX_FRAME_BYTES))
    await framed.send({"type": "open", "model_id": model_id, "start": start, "end": end,
                       "params": params or secret.params.name, "keys_digest": hashlib.sha256(keys).hexdigest(),
                       "keys_size": len(keys)})
    return framed, await framed.receive()


async def test_forged_keys_and_ciphertexts_get_errors_and_the_provider_keeps_serving(processes, tiny_model):
    (state,) = processes.nodes([("a", "0:2")], tiny_model)
    model_id = state["model_id"]
    config = load_config(tiny_model)
    secret = SecretContext()
    keys = secret.galois_keys(required_steps(config, secret.slots))
    rows, cols = group_shapes(config)["o"]
    plan = choose(rows, cols, secret.slots)
    (good,) = _encrypt(secret, plan, np.linspace(-1, 1, cols)[None])
    # A prompt of 5 tokens: the prompt plan, a full group of packed tokens and a partial one.
    prompt_x = np.random.default_rng(0).normal(0, 1, (5, cols))
    prompt_plan = choose(rows, cols, secret.slots, len(prompt_x))
    assert 1 < prompt_plan.tokens < len(prompt_x)
    prompt_cts = _encrypt(secret, prompt_plan, prompt_x)
    state_dict = read_tensors(tiny_model, lambda names: [n for n in names if n.endswith("o_proj.weight")])
    weight = group_weight({k: v.float().numpy() for k, v in state_dict.items()}, 0, "o")
    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=()) as swarm:
        host = swarm.host
        with trio.fail_after(120):
            # Keys that are not SEAL Galois keys (right digest, garbage inside).
            garbage = bytes(range(256)) * 64
            framed, opened = await _session(host, state, model_id, secret, garbage)
            assert opened["type"] == "opened" and opened["need_keys"]
            await framed.send({"type": "keys", "data": garbage})
            reply = await framed.receive()
            assert reply["type"] == "error" and reply["code"] == "bad_keys", reply
            assert await framed.receive() is None  # a session error ends the session
            # Parameters off the whitelist.
            framed, opened = await _session(host, state, model_id, secret, keys, params="ckks-1024-toy")
            assert opened["type"] == "error" and opened["code"] == "bad_params", opened
            assert await framed.receive() is None
            # More key bytes than this model's rotations can take: refused before any is sent.
            framed, opened = await _session(host, state, model_id, secret, b"k" * (100 << 20))
            assert opened["type"] == "error" and opened["code"] == "bad_keys", opened
            assert "at most" in opened["message"]
            # Real keys, then forged ciphertexts: each gets an error, the session goes on.
            framed, opened = await _session(host, state, model_id, secret, keys)
            assert opened["need_keys"]
            for offset in range(0, len(keys), KEYS_CHUNK):
                await framed.send({"type": "keys", "data": keys[offset:offset + KEYS_CHUNK]})
            reply = await framed.receive()
            assert reply["type"] == "keys_ok", reply
            truncated = good[: len(good) // 2]
            wrong_header = b"\x00" * 16 + good[16:]
            other_params = SecretContext(ParameterSet("other", 8192, (60, 40, 40, 60), 36, 36))
            other_context = other_params.encrypt(plan.input_slots(np.ones((1, cols)))[0])
            oversized = good[:8] + (10**9).to_bytes(8, "little") + good[16:]
            for forged in (truncated, wrong_header, other_context, oversized, b"x" * 100):
                await framed.send({"type": "project", "layer": 0, "group": "o", "tokens": 1, "cts": [forged]})
                reply = await framed.receive()
                assert reply is not None and reply["type"] == "error", (len(forged), reply and reply.get("type"))
                assert reply["code"] in ("bad_ciphertext", "worker_crashed"), reply
            # A flipped byte inside a compressed ciphertext may still decode to one that
            # is well formed: just another ciphertext (CKKS has no integrity), computed
            # on, which only its sender can decrypt. Either answer is right.
            flipped = bytearray(good)
            flipped[len(flipped) // 2] ^= 0xFF
            await framed.send({"type": "project", "layer": 0, "group": "o", "tokens": 1, "cts": [bytes(flipped)]})
            reply = await framed.receive()
            assert reply["type"] == "projected" or reply["code"] == "bad_ciphertext", reply
            # Ciphertexts that are not what the tokens' plan takes: an error, the session goes on.
            for tokens, cts in ((len(prompt_x), [good]), (1, [good, good]), (2, prompt_cts)):
                await framed.send({"type": "project", "layer": 0, "group": "o", "tokens": tokens, "cts": cts})
                reply = await framed.receive()
                assert reply["type"] == "error" and reply["code"] == "bad_ciphertext", reply
                assert "the plan takes" in reply["message"], reply
            # A good ciphertext after all that is served, and right.
            await framed.send({"type": "project", "layer": 0, "group": "o", "tokens": 1, "cts": [good]})
            product = _decrypt(secret, plan, 1, await framed.receive())
            assert product.shape == (1, rows)
            np.testing.assert_allclose(product[0], weight @ np.linspace(-1, 1, cols), atol=1e-4)
            await framed.send({"type": "project", "layer": 0, "group": "o", "tokens": len(prompt_x),
                               "cts": prompt_cts})
            product = _decrypt(secret, prompt_plan, len(prompt_x), await framed.receive())
            np.testing.assert_allclose(product, prompt_x @ weight.T, atol=1e-4)
            # A layer outside the span, a group that does not exist.
            await framed.send({"type": "project", "layer": 3, "group": "o", "tokens": 1, "cts": [good]})
            assert (await framed.receive())["code"] == "not_served"
            await framed.close()


async def test_a_crashed_he_worker_costs_one_request_not_the_node(processes, tiny_model):
    """SEAL's parsers are not hardened: a provider parses and computes in a worker
    process. Killing it (as a crash on hostile bytes would) costs the request in
    flight an error; the next one is served by a fresh worker that got the keys again."""
    import psutil

    proc, state = processes.node("a", tiny_model, "0:2")
    config = load_config(tiny_model)
    secret = SecretContext()
    keys = secret.galois_keys(required_steps(config, secret.slots))
    rows, cols = group_shapes(config)["down"]
    plan = choose(rows, cols, secret.slots)
    good = _encrypt(secret, plan, np.linspace(-2, 2, cols)[None])
    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=()) as swarm:
        with trio.fail_after(120):
            framed, opened = await _session(swarm.host, state, state["model_id"], secret, keys)
            for offset in range(0, len(keys), KEYS_CHUNK):
                await framed.send({"type": "keys", "data": keys[offset:offset + KEYS_CHUNK]})
            assert (await framed.receive())["type"] == "keys_ok"

            async def ask():
                await framed.send({"type": "project", "layer": 1, "group": "down", "tokens": 1, "cts": good})
                return await framed.receive()

            first = await ask()
            assert first["type"] == "projected"
            workers = [c for c in psutil.Process(proc.pid).children()
                       if "private_worker" in " ".join(c.cmdline())]
            assert len(workers) == 1
            workers[0].kill()
            psutil.wait_procs(workers, timeout=10)
            crashed = await ask()
            assert crashed["type"] == "error" and crashed["code"] == "worker_crashed", crashed
            again = await ask()
            assert again["type"] == "projected", again
            assert proc.poll() is None
            first_y = _decrypt(secret, plan, 1, first)
            again_y = _decrypt(secret, plan, 1, again)
            assert np.allclose(first_y, again_y, rtol=1e-5, atol=1e-5)
            await framed.close()


async def _reports_read_by_a_third_node(boot: list[str], accused: str, data_dir) -> int:
    """The verified failure reports against `accused` as nodes that are neither its
    reporter, itself nor the witness find them: a fresh host here (polled while the
    witness's provider record spreads), then a separate process (`compushare karma`)."""
    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               bootstrap=boot) as swarm:
        with trio.fail_after(60):
            while (await karma_of(swarm.host, swarm.dht, accused)).reports < 1:
                await trio.sleep(1.0)
    out = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "compushare", "karma", accused, "--json", "--data-dir", str(data_dir),
         "--bootstrap", boot[0]], capture_output=True, text=True, timeout=90))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["failure_reports"]


async def test_private_failover_and_a_lying_provider(processes, tiny_model, tmp_path):
    """Three providers of blocks 2:4, one adding noise to its products. With every step
    spot-checked (a random layer and product), the liar is found by a third opinion
    and avoided, and its signed product makes a failure report that its witness keeps
    and another node verifies; killing the route's provider of 2:4 mid-generation
    moves the layers to another one with nothing to replay, and the generation completes."""
    import signal

    from compushare.pipeline.client.consumer import Consumer

    a = processes.nodes([("a", "0:2")], tiny_model)[0]
    boot = a["addrs"][:1]
    liar = processes.node("liar", tiny_model, "2:4", bootstrap=boot, extra=["--debug-noise", "0.05"], wait=False)[0]
    honest = [processes.node(name, tiny_model, "2:4", bootstrap=boot, wait=False)[0] for name in ("c", "d")]
    liar_state = processes.ready("liar", liar)
    honest_states = [processes.ready(name, p) for name, p in zip(("c", "d"), honest)]
    servers = {liar_state["peer_id"]} | {state["peer_id"] for state in honest_states}

    def all_three_in_view() -> bool:  # A's view, which the consumer learns: a liar not in it is never asked
        return servers <= {peer["peer_id"] for peer in dashboard(processes.root / "a", a)["peers"]
                           for serving in peer["serving"] if serving["state"] == "serving" and serving["start"] == 2}

    wait_until(all_three_in_view, "A's view shows the liar and both honest servers of 2:4 serving")
    client = tmp_path / "client"
    import_path(tiny_model, client, alias="tiny")
    prompt = [1, 9, 8, 7, 6]
    killed: list[str] = []
    async with Consumer.connect(client, tuple(boot), "tiny", text_prompts=False, spot_check_rate=1.0) as consumer:
        # A 20-token prompt: its prefill is pipelined, and a check failed there is redone too.
        outcome = await consumer.generate(RunRequest(model="tiny", prompt=prompt * 4, private=True,
                                                     params=SamplingParams(max_new_tokens=16, stop_at_eos=False)))
        assert liar_state["peer_id"] in outcome.private["check_failures"]
        assert liar_state["peer_id"] not in {h.peer_id for h in outcome.route}
        assert outcome.checks > 0
        # The liar's signed product against an honest one: a report anyone can check.
        assert outcome.reports and all(isinstance(r, PrivateFailureReport) for r in outcome.reports)
        assert {r.accused.peer_id for r in outcome.reports} == {liar_state["peer_id"]}
        assert {r.witness.peer_id for r in outcome.reports} <= {s["peer_id"] for s in honest_states}
        for report in outcome.reports:
            report.check()
        assert await _reports_read_by_a_third_node(boot, liar_state["peer_id"], tmp_path / "reader") >= 1

        # Kill the honest provider of 2:4 the route uses, after a few tokens.
        by_peer = {s["peer_id"]: p for s, p in zip(honest_states, honest)}

        tokens_seen = []

        def kill_route_provider(token: int) -> None:
            tokens_seen.append(token)
            if len(tokens_seen) == 3 and not killed:
                peer = next(h.peer_id for h in chain_route[0] if h.start >= 2)
                killed.append(peer)
                by_peer[peer].send_signal(signal.SIGKILL)

        chain_route: list = []
        outcome2 = await consumer.generate(
            RunRequest(model="tiny", prompt=prompt, private=True,
                       params=SamplingParams(max_new_tokens=12, stop_at_eos=False)),
            on_route=lambda route: chain_route.append(route), on_token=kill_route_provider)
    assert killed and killed[0] in by_peer
    assert outcome2.tokens == reference_greedy(tiny_model, prompt, 12)
    assert any(f.peer_id == killed[0] for f in outcome2.failovers)
    assert killed[0] not in {h.peer_id for h in outcome2.route}
