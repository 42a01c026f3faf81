"""Fine-tuning through the swarm (/compushare/train): a consumer's LoRA gradients
through 3 node processes equal one process's (transformers + PEFT), a killed server
costs no step, a lying server's gradients are caught by a spot check."""

import os
import signal

import pytest
import trio

from compushare.model.arch import load_config
from compushare.model.catalog import import_path
from compushare.model.training_state import OptimizerSettings, TrainingState
from compushare.pipeline.client.consumer import Consumer
from compushare.proofs.reports import parse_report
from helpers import liar_and_honest
from training_helpers import adapter_for, max_difference, microbatches, peft_gradients, per_projection, trainer_for

pytestmark = pytest.mark.integration


async def test_swarm_gradients_equal_one_process(processes, tiny_model, tmp_path):
    _, first = processes.node("a", tiny_model, "0:1")
    boot = first["addrs"][:1]
    processes.nodes([("b", "1:3"), ("c", "3:4")], tiny_model, bootstrap=boot)
    client = tmp_path / "client"
    import_path(tiny_model, client, alias="tiny")
    async with Consumer.connect(client, tuple(boot), "tiny", text_prompts=False) as consumer:
        trainer = await trainer_for(consumer, spot_check_rate=0.0)
        assert [(s.start, s.end) for s in trainer.stages] == [(0, 1), (1, 3), (3, 4)]
        batches = microbatches(load_config(tiny_model).vocab_size)
        expected_loss, expected = peft_gradients(tiny_model, trainer.state.adapter(), batches)
        loss, _, grads = await trainer.gradients(batches)
        assert abs(loss - expected_loss) <= 1e-5
        assert max_difference(grads, expected) <= 1e-5
        stats = await trainer.step(batches)
        assert stats.step == 1 and abs(stats.loss - expected_loss) <= 1e-5
        receipts = [r for stage in trainer.stages for hop in stage.hops for r in hop.receipts]
        assert len(receipts) == 3 and all(r.tokens > 0 for r in receipts)  # karma for the training work
        await trainer.close()


@pytest.mark.parametrize("fmt", ["q4", "int8"])
async def test_gradients_through_quantized_spans_equal_one_process_on_their_weights(processes, tiny_model, tmp_path,
                                                                                   fmt):
    """Three node processes serving q4 (int8) spans give the LoRA gradients one process
    computes with PEFT over the same weights dequantized, within the bfloat16 rounding of
    the kernels' activations (measured per projection)."""
    from compushare.model.blocks import load_full_model

    _, first = processes.node("a", tiny_model, "0:1", fmt=fmt)
    boot = first["addrs"][:1]
    processes.nodes([("b", "1:3"), ("c", "3:4")], tiny_model, bootstrap=boot, fmt=fmt)
    client = tmp_path / "client"
    stored = import_path(tiny_model, client, alias="tiny", fmt=fmt)
    async with Consumer.connect(client, tuple(boot), "tiny", text_prompts=False) as consumer:
        trainer = await trainer_for(consumer, spot_check_rate=0.0)
        batches = microbatches(load_config(tiny_model).vocab_size)
        reference = load_full_model(stored.path)
        expected_loss, expected = peft_gradients(tiny_model, trainer.state.adapter(), batches, base=reference)
        loss, _, grads = await trainer.gradients(batches)
        errors = per_projection(grads, expected)
        print(f"{fmt}: loss {loss:.6f} against {expected_loss:.6f}; gradients, relative, per projection: {errors}")
        assert abs(loss - expected_loss) <= 1e-2 * abs(expected_loss)
        assert max(errors.values()) <= 5e-2, errors
        stats = await trainer.step(batches)
        assert stats.step == 1
        await trainer.close()


async def test_killed_server_mid_step_costs_no_step(processes, tiny_model, tmp_path):
    """B serves 2:4 and is the route's; C serves 2:4 too, slower. B is killed (SIGKILL)
    once it has answered a request of the step: the step completes on C, and its
    gradients are still exactly the one-process gradients."""
    _, a, b, c = None, *liar_and_honest_nodes(processes, tiny_model, liar_noise=None)
    client = tmp_path / "client"
    import_path(tiny_model, client, alias="tiny")
    async with Consumer.connect(client, tuple(a["addrs"][:1]), "tiny", text_prompts=False) as consumer:
        trainer = await trainer_for(consumer, spot_check_rate=0.0)
        assert trainer.stages[1].hops[0].peer_id == b["peer_id"]
        batches = microbatches(load_config(tiny_model).vocab_size, count=3)
        _, expected = peft_gradients(tiny_model, trainer.state.adapter(), batches)
        killed = trio.Event()

        async def kill_b_once_used():
            hop = trainer.stages[1].hops[0]
            with trio.fail_after(60):
                while hop.requests < 1:
                    await trio.sleep(0.005)
            os.kill(b["pid"], signal.SIGKILL)
            killed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_b_once_used)
            stats = await trainer.step(batches)
        assert killed.is_set() and stats.step == 1 and trainer.failovers >= 1
        assert [h.peer_id for h in trainer.stages[1].hops] == [c["peer_id"]]
        # The step's update is the one the lost requests would have given: recompute
        # this step's gradients at the starting point and compare.
        fresh = TrainingState(adapter_for(tiny_model, trainer.model_id), OptimizerSettings(lr=1e-3))
        trainer.state, kept = fresh, trainer.state
        _, _, grads = await trainer.gradients(batches)
        assert max_difference(grads, expected) <= 1e-5
        assert kept.step == 1
        await trainer.close()


@pytest.mark.parametrize("fmt", [None, "q4"])
async def test_lying_server_caught_by_a_gradient_spot_check(processes, tiny_model, tmp_path, fmt):
    """B serves 2:4 and adds noise to what it returns; C and D serve 2:4 honestly. With
    every answer checked, B is caught: a signed failure report names it (anyone can
    check it), B is replaced, and the step's gradients are the honest ones. On q4
    spans too: the honest servers agree within the format's tolerance (their
    difference measured and printed), the liar does not."""
    from compushare.model.blocks import load_full_model
    from compushare.proofs.inference import tolerance

    a, b, c = liar_and_honest_nodes(processes, tiny_model, liar_noise="0.05", fmt=fmt)
    # D is slow like C (an honest verifier, never the route's choice over the fast B).
    d = processes.node("d", tiny_model, "2:4", bootstrap=a["addrs"][:1], extra=["--debug-slowdown", "30"], fmt=fmt)[1]
    client = tmp_path / "client"
    stored = import_path(tiny_model, client, alias="tiny", fmt=fmt)
    async with Consumer.connect(client, tuple(a["addrs"][:1]), "tiny", text_prompts=False) as consumer:
        trainer = await trainer_for(consumer, spot_check_rate=1.0)
        with trio.fail_after(60):  # C and D known as verifiers
            while trainer.planner.verifier(2, 4, {b["peer_id"], c["peer_id"]}) is None:
                await trainer.planner.refresh()
                await trio.sleep(0.2)
        assert trainer.stages[1].hops[0].peer_id == b["peer_id"]
        batches = microbatches(load_config(tiny_model).vocab_size, count=1)
        base = None if fmt is None else load_full_model(stored.path)
        _, expected = peft_gradients(tiny_model, trainer.state.adapter(), batches, base=base)
        _, _, grads = await trainer.gradients(batches)
        assert trainer.mismatches and set(trainer.mismatches) == {b["peer_id"]}
        assert trainer.reports, "a failure report was filed"
        for report in trainer.reports:
            again = parse_report(report.to_wire())
            again.check()  # verifies from its bytes alone
            assert again.accused.peer_id == b["peer_id"] and again.witness.peer_id in {c["peer_id"], d["peer_id"]}
        assert b["peer_id"] not in {h.peer_id for s in trainer.stages for h in s.hops}
        honest = [e for x, y, e in trainer.compared if b["peer_id"] not in (x, y)]
        lying = [e for x, y, e in trainer.compared if b["peer_id"] in (x, y)]
        allowed = tolerance(consumer.model.format.label, 2)
        print(f"{fmt or 'fp32'}: honest servers differ by {honest}, the liar by {lying} (tolerance {allowed})")
        assert honest and max(honest) <= allowed < min(lying)
        if fmt is None:
            assert max_difference(grads, expected) <= 1e-5
        else:
            assert max(per_projection(grads, expected).values()) <= 5e-2
        await trainer.close()


def liar_and_honest_nodes(processes, model_dir, *, liar_noise: str | None, fmt: str | None = None):
    """A serves 0:2; B serves 2:4, fast (with `liar_noise`, it lies); C serves 2:4,
    slowly, so routes prefer B (helpers.liar_and_honest with the noise optional)."""
    if liar_noise is not None:
        a, _, b, c = liar_and_honest(processes, model_dir, fmt=fmt, noise=float(liar_noise))
        return a, b, c
    _, a = processes.node("a", model_dir, "0:2")
    boot = a["addrs"][:1]
    fast_ads = ["--ad-period", "1"]
    b = processes.node("b", model_dir, "2:4", bootstrap=boot, extra=fast_ads, wait=False)[0]
    c = processes.node("c", model_dir, "2:4", bootstrap=boot, extra=["--debug-slowdown", "30"] + fast_ads,
                       wait=False)[0]
    return a, processes.ready("b", b), processes.ready("c", c)


# Measured (this file's test): the largest relative difference per projection from
# PEFT over the file's weights dequantized to float32. The kernels' bfloat16
# activations and scales account for it (the f32 file: 1e-6).
GGUF_TOLERANCE = {"tiny-qwen2-f32.gguf": 1e-4, "tiny-qwen2-q8_0.gguf": 0.25}


@pytest.mark.parametrize("name", sorted(GGUF_TOLERANCE))
async def test_gradients_through_ggml_spans_equal_one_process_on_the_files_weights(processes, tmp_path, name):
    """Two node processes serving a GGUF on ggml train through it: each layer on torch
    from the same file, one at a time (model/span_training.py). The gradients equal one
    process's on the same kernels (LocalTrainer), and PEFT's over the file's weights
    dequantized within GGUF_TOLERANCE (printed per projection)."""
    from pathlib import Path

    from compushare.model.blocks import SpanRunner, load_full_model
    from compushare.model.local_training import LocalTrainer

    gguf = Path(__file__).resolve().parents[1] / "data" / "gguf" / name
    _, first = processes.node("a", gguf, "0:1", fmt="gguf")
    processes.node("b", gguf, "1:2", fmt="gguf", bootstrap=first["addrs"][:1])
    client = tmp_path / "client"
    stored = import_path(gguf, client, alias="tiny", fmt="gguf")
    async with Consumer.connect(client, tuple(first["addrs"][:1]), "tiny", text_prompts=False) as consumer:
        trainer = await trainer_for(consumer, spot_check_rate=0.0)
        assert [(s.start, s.end) for s in trainer.stages] == [(0, 1), (1, 2)]
        batches = microbatches(load_config(stored.path).vocab_size)
        loss, _, grads = await trainer.gradients(batches)
        local = LocalTrainer(SpanRunner.load(stored.path, 0, 2), consumer.head, trainer.state)
        local_loss, _, local_grads = local.gradients(batches)
        assert abs(loss - local_loss) <= 1e-5 * abs(local_loss)
        assert max(per_projection(grads, local_grads).values()) <= 1e-4
        expected_loss, expected = peft_gradients(stored.path, trainer.state.adapter(), batches,
                                                 base=load_full_model(stored.path))
        errors = per_projection(grads, expected)
        print(f"{name} on ggml: loss {loss:.6f} against {expected_loss:.6f}; per projection: {errors}")
        assert abs(loss - expected_loss) <= 1e-3 * abs(expected_loss)
        assert max(errors.values()) <= GGUF_TOLERANCE[name], errors
        assert (await trainer.step(batches)).step == 1
        await trainer.close()
