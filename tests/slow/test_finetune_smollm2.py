"""Gradients of a LoRA adapter on the real SmolLM2-135M through 3 node processes
serving quantized spans (blocks 0:10, 10:20, 20:30) against one process with PEFT
over the same weights dequantized: on our q4 (torch) and on a Q4_K_M GGUF (ggml,
trained on torch a layer at a time). The differences are measured per projection
and printed; the bounds below are those measurements with room (docs/performance.md)."""

import pytest

from compushare.config import resolve_cache_dir
from compushare.model.arch import load_config
from compushare.model.blocks import load_full_model
from compushare.model.catalog import import_path, resolve_model
from compushare.model.sources import smollm2_gguf
from compushare.pipeline.client.consumer import Consumer
from gguf_files import requantize
from training_helpers import microbatches, peft_gradients, per_projection, trainer_for

pytestmark = pytest.mark.slow

# The largest relative difference over each projection's factors, from PEFT over the
# dequantized weights in float32: the kernels take bfloat16 activations.
TOLERANCE = {"q4": 0.1, "Q4_K_M": 0.1}


@pytest.mark.parametrize("fmt", sorted(TOLERANCE))
async def test_smollm2_gradients_through_quantized_nodes_equal_one_process(processes, tmp_path, fmt):
    if fmt == "q4":
        source, import_fmt = resolve_model("smollm2-135m", tmp_path / "fp32").path, "q4"
    else:  # SmolLM2's own GGUF (Q4_1), its layers requantized as llama-quantize's Q4_K_M lays them out
        source, import_fmt = requantize(smollm2_gguf(resolve_cache_dir()), tmp_path / "smollm2-q4_k_m.gguf"), "gguf"
    _, first = processes.node("a", source, "0:10", fmt=import_fmt, alias="smol")
    boot = first["addrs"][:1]
    processes.nodes([("b", "10:20"), ("c", "20:30")], source, bootstrap=boot, fmt=import_fmt, alias="smol")
    client = tmp_path / "client"
    stored = import_path(source, client, alias="smol", fmt=import_fmt)
    async with Consumer.connect(client, tuple(boot), "smol", text_prompts=False) as consumer:
        trainer = await trainer_for(consumer, spot_check_rate=0.0)
        assert [(s.start, s.end) for s in trainer.stages] == [(0, 10), (10, 20), (20, 30)]
        batches = microbatches(load_config(stored.path).vocab_size, count=1, rows=2, length=16)
        loss, _, grads = await trainer.gradients(batches)
        expected_loss, expected = peft_gradients(stored.path, trainer.state.adapter(), batches,
                                                 base=load_full_model(stored.path))
        errors = per_projection(grads, expected)
        print(f"SmolLM2 {fmt}: loss {loss:.6f} against {expected_loss:.6f}; per projection: "
              + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        assert abs(loss - expected_loss) <= 1e-2 * abs(expected_loss)
        assert max(errors.values()) <= TOLERANCE[fmt], errors
        await trainer.close()
