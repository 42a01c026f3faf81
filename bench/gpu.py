"""Spans on a CUDA device: an 8B-shaped span's decode and prefill in bf16 and q4, against
plain torch and the memory-bandwidth bound; and a chain with its middle span on CUDA.

    PYTHONPATH=src python3 bench/gpu.py [--blocks 8] [--results bench/results/gpu.jsonl]
    .venv/bin/python bench/gpu.py --device cpu --blocks 1 --quick --results ''   # a smoke test

Imports only torch, transformers, numpy, safetensors and psutil (and this checkout's
compushare.model / compushare.net.tensors, which need no more): it runs on a machine
with torch but none of the node's network stack. Each part is measured in its own
try/except: one that fails puts {"error": ...} in the JSON, the others still run.

device     the device's name, compute capability, memory; torch and transformers versions.
bandwidth  device copy bandwidth: a 1 GiB buffer copied (median of 10 after 3 warm-ups),
           counting bytes read and written (a matrix-vector product reads its weights
           once: the bound below divides the weights' bytes by this).
kernel     one 14336 x 4096 product (Llama-3.1-8B's gate/up), one token: nn.Linear in
           bf16, our q4 (CudaInt4Linear, group 64), our int8 (two int4 planes), and
           torch's `_weight_int8pack_mm` where it runs on the device; each quantized
           module's relative error against the product of its dequantized weights.
spans      `--blocks` blocks of Llama-3.1-8B's shapes (hidden 4096, MLP 14336, 32 heads,
           8 KV heads), random weights built a matrix at a time (SpanRunner.random_from_config),
           per format (bf16; q4: q, o, gate, up 4-bit in groups of 64, k, v, down int8):
           decode     one session: 16-token prefill, 3 warm-up steps, `--steps` timed steps;
                      ms per step per block, and steps/s through the span
           batch8     8 sessions' steps as one forward (model/batched.py), as many steps;
                      speedup = tokens/s with 8 sessions / tokens/s with one
           prefill    a `--prefill`-token prompt on a fresh cache (1 warm-up, median of 3)
           memory     the device's peak allocated memory from the span's build to its end,
                      and the span's weights as held (scales included)
           bound      weights bytes per block / copy bandwidth: the least time a decode step
                      can take per block; vs_bound = bound / measured (1.0 = at bandwidth)
eager      the same span's plain transformers forward in bf16 on the device (LlamaModel of
           `--blocks` layers, inputs_embeds, its DynamicCache; eager launches, no CUDA
           graphs): decode ms per block and prefill tok/s, the baseline of our lean path.
chain      a tiny random Llama (6 layers, hidden 256, vocab 2048; weights std 0.2 so
           greedy choices are decisive) served as three spans, 0:2 and 4:6 on CPU, 2:4 on
           `--device`, hidden states through the wire encoding (net/tensors.py) between
           them, head (embedding, norm, LM head) on CPU; against the same three spans all
           on CPU: greedy tokens for 3 prompts x 32 tokens, per format (fp32, q4), the
           tokens' agreement and the middle span's largest output difference relative
           to its largest output value (prefill of each prompt).

The last line is one JSON object, also appended to `--results` (default
bench/results/gpu.jsonl; '' skips it).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback

from _common import finish

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINY = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_hidden_layers=6, vocab_size=2048, initializer_range=0.2, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=False)
CHAIN_SPANS = ((0, 2, "cpu"), (2, 4, None), (4, 6, "cpu"))  # None: --device


def part(result: dict, name: str, run) -> None:
    """Run one part; its figures, or its error with the traceback's last lines, go under `name`."""
    began = time.perf_counter()
    try:
        result[name] = run()
    except Exception as exc:  # a part's failure must not lose the others' figures
        traceback.print_exc()
        result[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    print(f"[{name}] {time.perf_counter() - began:.1f} s: {result[name]}", flush=True)
    gc.collect()


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, run, repeat: int, warmup: int = 1) -> float:
    """Median seconds of `run()` over `repeat` calls after `warmup`."""
    for _ in range(warmup):
        run()
    sync(device)
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def device_info(device) -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        from compushare.hardware import cuda_accelerator

        accelerator = cuda_accelerator(device.index or 0)
        info |= {"device": accelerator.label, "name": accelerator.name, "total_mb": accelerator.total_mb,
                 "free_mb": accelerator.free_mb, "capability": list(accelerator.capability)}
    return info


def copy_bandwidth(device, quick: bool) -> dict:
    import torch

    size = (64 if quick else 1024) * 2**20
    source = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    seconds = timed(device, lambda: target.copy_(source), 3 if quick else 10, 3)
    return {"bytes": size, "ms": round(seconds * 1e3, 4), "gb_s": round(2 * size / seconds / 1e9, 1)}


def kernel_products(device, quick: bool) -> dict:
    import torch

    from compushare.model import kernels
    from compushare.model.quantize import dequantize, quantize_int8, quantize_q4

    out_features, in_features = (14336, 4096) if not quick else (256, 512)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.02
    x = torch.randn(1, in_features, generator=generator)
    rows = {}
    q4 = quantize_q4(weight, 64, steps=2)  # the search only moves values, not the speed
    int8 = quantize_int8(weight)
    for label, parts in (("bf16", {"": weight.to(torch.bfloat16)}), ("q4", q4), ("int8", int8)):
        module = kernels.linear(parts, device)
        x_dev = x.to(device).to(torch.bfloat16 if label == "bf16" else torch.float32)
        seconds = timed(device, lambda m=module, v=x_dev: m(v), 5 if quick else 100, 5)
        row = {"module": type(module).__name__, "us": round(seconds * 1e6, 2),
               "held_bytes": sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))}
        row["gb_s"] = round(row["held_bytes"] / seconds / 1e9, 1)
        if label != "bf16":
            reference = x.to(torch.bfloat16).float() @ dequantize(parts).t()
            got = module(x_dev).float().cpu()
            row["rel_error"] = float((got - reference).abs().max() / reference.abs().max())
        rows[label] = row
        del module
    try:  # torch's own int8 weight-only kernel, where it runs on this device
        q, scale = int8[""].to(device), int8["_scale"].to(torch.bfloat16).to(device)
        x_dev = x.to(device).to(torch.bfloat16)
        seconds = timed(device, lambda: torch.ops.aten._weight_int8pack_mm(x_dev, q, scale), 5 if quick else 100, 5)
        rows["int8pack_mm"] = {"us": round(seconds * 1e6, 2), "gb_s": round(q.numel() / seconds / 1e9, 1)}
    except (RuntimeError, NotImplementedError) as exc:
        rows["int8pack_mm"] = {"error": str(exc).splitlines()[0][:200]}
    if device.type == "cuda":
        rows["int4_form"] = kernels.cuda_int4_form(device)
    return {"shape": f"{out_features}x{in_features}"} | rows


def llama_8b_config(blocks: int):
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA_8B, num_hidden_layers=blocks, vocab_size=128256)
    config._attn_implementation = "sdpa"
    return config


def span_figures(device, fmt_text: str, blocks: int, steps: int, prefill: int, bandwidth_gb_s: float | None,
                 quick: bool) -> dict:
    import torch

    from compushare.model.batched import decode_batch
    from compushare.model.blocks import SpanRunner
    from compushare.model.formats import parse_format
    from compushare.model.selfbench import time_decode_steps

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    runner = SpanRunner.random_from_config(llama_8b_config(blocks), parse_format(fmt_text), 0, blocks, device=device)
    built_s = time.perf_counter() - began
    generator = torch.Generator().manual_seed(0)
    hidden = runner.hidden_size
    token = torch.randn(1, 1, hidden, generator=generator)
    out = {"format": runner.format_label, "build_s": round(built_s, 1), "weight_bytes": runner.weight_bytes,
           "modules": sorted({type(m).__name__ for layer in runner.layers.values() for m in layer.modules()
                              if not list(m.children()) and m.__class__.__module__.startswith("compushare")
                              or isinstance(m, torch.nn.Linear)})}

    def fresh_session():
        cache = runner.new_cache()
        runner.forward(torch.randn(1, 16, hidden, generator=generator), cache, 0)
        return cache

    step_s = time_decode_steps(runner, token, fresh_session(), 16, warmup=3, steps=steps)
    out |= {"decode_ms_per_block": round(step_s * 1e3 / blocks, 4), "decode_steps_s": round(1 / step_s, 2)}
    caches = [fresh_session() for _ in range(8)]
    positions = [16] * 8
    tokens = [token] * 8
    for _ in range(2):
        decode_batch(runner, tokens, caches, positions, runner.start, runner.end)
        positions = [p + 1 for p in positions]
    began = time.perf_counter()
    for _ in range(steps):
        decode_batch(runner, tokens, caches, positions, runner.start, runner.end)
        positions = [p + 1 for p in positions]
    batch_s = (time.perf_counter() - began) / steps
    out |= {"batch8_ms_per_block": round(batch_s * 1e3 / blocks, 4), "batch8_tok_s": round(8 / batch_s, 2),
            "batch8_speedup": round(step_s * 8 / batch_s, 2)}
    del caches
    prompt = torch.randn(1, prefill, hidden, generator=generator)
    seconds = timed(device, lambda: runner.forward(prompt, runner.new_cache(), 0), 1 if quick else 3, 1)
    out |= {"prefill_tokens": prefill, "prefill_tok_s": round(prefill / seconds, 1)}
    if device.type == "cuda":
        out["peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    if bandwidth_gb_s:
        bound_ms = runner.weight_bytes / blocks / (bandwidth_gb_s * 1e9) * 1e3
        out |= {"bound_ms_per_block": round(bound_ms, 4), "vs_bound": round(bound_ms / (step_s * 1e3 / blocks), 3)}
    return out


def eager_figures(device, blocks: int, steps: int, prefill: int, quick: bool) -> dict:
    """transformers' own LlamaModel (bf16, `blocks` layers) on the device: eager, its own cache."""
    import torch
    from transformers import DynamicCache, LlamaModel

    config = llama_8b_config(blocks)
    config.vocab_size = 256  # inputs_embeds: the embedding is never read
    with torch.device(device):
        model = LlamaModel(config).to(torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(0)
    token = torch.randn(1, 1, config.hidden_size, generator=generator).to(device, torch.bfloat16)

    @torch.inference_mode()
    def step(embeds, cache):
        return model(inputs_embeds=embeds, past_key_values=cache, use_cache=True).last_hidden_state

    cache = DynamicCache(config=config)
    step(torch.randn(1, 16, config.hidden_size, generator=generator).to(device, torch.bfloat16), cache)
    for _ in range(3):
        step(token, cache)
    sync(device)
    began = time.perf_counter()
    for _ in range(steps):
        step(token, cache)
    sync(device)
    step_s = (time.perf_counter() - began) / steps
    prompt = torch.randn(1, prefill, config.hidden_size, generator=generator).to(device, torch.bfloat16)
    seconds = timed(device, lambda: step(prompt, DynamicCache(config=config)), 1 if quick else 3, 1)
    return {"decode_ms_per_block": round(step_s * 1e3 / blocks, 4), "prefill_tok_s": round(prefill / seconds, 1)}


def chain_figures(device) -> dict:
    """The tiny Llama as three spans, the middle one on `device`, against all three on CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from compushare.model.blocks import SpanRunner
    from compushare.model.formats import parse_format
    from compushare.model.quantize import quantize
    from compushare.net.tensors import decode_tensor, encode_tensor

    config = LlamaConfig(**TINY)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    layer_weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("model.layers.")}
    prompts = [torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
               for seed in (1, 2, 3)]
    figures = {}
    for fmt_text in ("fp32", "q4"):
        fmt = parse_format(fmt_text)
        state = {}
        for name, weight in layer_weights.items():
            state |= quantize(fmt, name, weight)

        def chain(middle):
            return [SpanRunner(config, start, end, dict(state), device=where or middle)
                    for start, end, where in CHAIN_SPANS]

        mixed, cpu = chain(device), chain("cpu")
        runs = {"mixed": [], "cpu": []}
        worst = 0.0
        for prompt in prompts:
            for label, spans in (("mixed", mixed), ("cpu", cpu)):
                runs[label].append(greedy(model, spans, prompt, 32, config, decode_tensor, encode_tensor))
            # The middle span alone, on the same input: CUDA against CPU.
            with torch.inference_mode():
                embedded = model.model.embed_tokens(torch.tensor([prompt]))
                first = cpu[0].forward(embedded, cpu[0].new_cache(), 0)
                on_device = mixed[1].forward(first, mixed[1].new_cache(), 0)
                on_cpu = cpu[1].forward(first, cpu[1].new_cache(), 0)
            worst = max(worst, float((on_device - on_cpu).abs().max() / on_cpu.abs().max()))
        same = [a == b for a, b in zip(runs["mixed"], runs["cpu"], strict=True)]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                      for a, b in zip(runs["mixed"], runs["cpu"], strict=True)]
        figures[fmt_text] = {"identical_prompts": sum(same), "prompts": len(prompts), "first_diff": first_diff,
                             "middle_rel_diff": worst, "middle_device": str(mixed[1].device),
                             "middle_modules": sorted({type(m).__name__ for m in mixed[1].layers[2].modules()
                                                       if not list(m.children())})}
    return figures


def greedy(model, spans, prompt: list[int], tokens: int, config, decode_tensor, encode_tensor) -> list[int]:
    """Greedy tokens through `spans`, the wire encoding between them, the head on CPU."""
    import torch

    caches = [span.new_cache() for span in spans]
    out, ids, position = [], prompt, 0
    with torch.inference_mode():
        for _ in range(tokens):
            hidden = model.model.embed_tokens(torch.tensor([ids]))
            for span, cache in zip(spans, caches, strict=True):
                hidden = span.forward(hidden, cache, position)
                hidden = decode_tensor(encode_tensor(hidden), hidden_size=config.hidden_size, max_tokens=4096)
            position += len(ids)
            next_id = int(model.lm_head(model.model.norm(hidden[:, -1:])).argmax())
            out.append(next_id)
            ids = [next_id]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32; 2 with --quick)")
    parser.add_argument("--prefill", type=int, default=None, help="prompt tokens (default 512; 32 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    parser.add_argument("--results", default="bench/results/gpu.jsonl")
    args = parser.parse_args()
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    steps = args.steps or (2 if args.quick else 32)
    prefill = args.prefill or (32 if args.quick else 512)
    result: dict = {"bench": "gpu", "blocks": args.blocks, "steps": steps, "quick": args.quick}
    part(result, "device_info", lambda: device_info(device))
    result["device"] = result["device_info"].get("device", str(device))
    part(result, "bandwidth", lambda: copy_bandwidth(device, args.quick))
    bandwidth = result["bandwidth"].get("gb_s")
    part(result, "kernel", lambda: kernel_products(device, args.quick))
    for fmt in ("bf16", "q4"):
        part(result, fmt, lambda fmt=fmt: span_figures(device, fmt, args.blocks, steps, prefill, bandwidth, args.quick))
    part(result, "eager_bf16", lambda: eager_figures(device, args.blocks, steps, prefill, args.quick))
    part(result, "chain", lambda: chain_figures(device))
    bf16, q4 = result["bf16"], result["q4"]
    result |= {"bf16_decode_ms_per_block": bf16.get("decode_ms_per_block"),
               "q4_decode_ms_per_block": q4.get("decode_ms_per_block"),
               "q4_vs_bandwidth_bound": q4.get("vs_bound"), "bf16_vs_bandwidth_bound": bf16.get("vs_bound"),
               "batch8_speedup": q4.get("batch8_speedup"), "bf16_batch8_speedup": bf16.get("batch8_speedup"),
               "prefill_tok_s": q4.get("prefill_tok_s"), "bf16_prefill_tok_s": bf16.get("prefill_tok_s"),
               "eager_bf16_decode_ms_per_block": result["eager_bf16"].get("decode_ms_per_block"),
               "peak_mb": max(bf16.get("peak_mb", 0), q4.get("peak_mb", 0)) or None,
               "errors": sorted(name for name, value in result.items()
                                if isinstance(value, dict) and "error" in value)}
    return finish(result, args.results)


if __name__ == "__main__":
    raise SystemExit(main())
