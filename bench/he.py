"""Private mode: encrypted projections (CKKS) per product and per layer, and
generation through local swarms whose providers only see ciphertexts.

    .venv/bin/python bench/he.py [--repeats 10] [--naive-repeats 2] [--new-tokens 4]
                                 [--prompt-tokens 128] [--threads 1,2] [--no-swarm] [--no-qwen]

product   one 576 x 576 projection of one token: SmolLM2's real q_proj weight of
          layer 0, applied to that layer's real input for the prompt's last token.
          Single-threaded. naive: TenSEAL's own CKKSVector.mm with the plain matrix
          (N = 8192, coeff [60, 40, 40, 60], 2^40, all power-of-two rotations; 1
          thread, and TenSEAL's default thread count beside it); packed:
          EncodedMatrix.apply of the decode plan (he/plan.py: two columns a complex
          slot, baby-step giant-step windows) on pre-encoded weights, one loaded
          input; on_the_fly: the weights encoded per request; plain: torch fp32.
layer     SmolLM2 layer 0's 4 group products (qkv, o, gate_up, down) on real weights,
          in the decode plan (1 token) and the prompt plan (its tokens a ciphertext,
          per token), as one HE worker computes them and as each of two workers
          computes its share (the wall time with 2 threads is the slower share's).
          Beside each, the cost model's prediction (he/plan.py's units times this
          machine's measured plaintext product + add), and the floor: the plaintext
          products alone, shared by the threads.
swarm     for each --threads value t: 3 provider processes on 127.0.0.1 (blocks 0:10,
          10:20, 20:30), each with [limits] compute_threads = t (t HE worker
          processes), and this process as the consumer, greedy, no spot checks. A
          warm-up private generation (the HE workers load and pre-encode), then a
          --prompt-tokens prompt (a public-domain paragraph, cut to that many
          tokens; fewer where this machine's layer time says the runs would not fit the
          20-minute limit: fitted_prompt) with --new-tokens, privately, then the same in
          plaintext.
          prefill_s_per_token  the first token's time over the prompt's tokens
                   (the prompt pipelined over the hops in chunks);
          decode_s_per_token   first token to last over the decode steps;
          breakdown per decode step (PrivateStats): encrypt, decrypt, providers'
                   compute, transfer, local layers; CPU of the HE workers and of this
                   process; RSS of every node and its workers.
          fetch    (first run) what a consumer holding nothing fetches from the swarm
                   for one private token, beside one plaintext token (the head):
                   consumer_fetch_mb and head_fetch_mb, bytes on disk after.
          prefill_s_per_token (the JSON's) is the better of the runs (the three
          providers share this machine's 2 cores, so the pipeline already keeps both
          busy and a second worker each mostly adds its duplicated rotations); each
          run's figures are in the JSON under _1thread and _2threads.
qwen05    a 3-layer Qwen2 model with Qwen2.5-0.5B's widths (hidden 896, 14/2 heads,
          intermediate 4,864 > the 4,096 slots; random weights), one layer a
          provider, 2 HE workers each: private tokens equal to plaintext ones.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: E402, F401  (this checkout's src/)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import trio  # noqa: E402

from compushare.he.ckks import SecretContext  # noqa: E402
from compushare.he.groups import GROUPS, group_weight, preencoded_bytes, required_steps  # noqa: E402
from compushare.he.matvec import EncodedMatrix  # noqa: E402
from compushare.he.plan import choose, decode_plan, prompt_plan  # noqa: E402
from compushare.model.arch import load_config  # noqa: E402
from compushare.model.catalog import import_path, resolve_model  # noqa: E402
from compushare.model.weights import read_tensors  # noqa: E402
from compushare.pipeline.client import private_chain  # noqa: E402
from compushare.pipeline.client.consumer import Consumer, RunRequest, load_tokenizer, prompt_ids_of  # noqa: E402
from compushare.pipeline.client.sampling import SamplingParams  # noqa: E402
from local_swarm import LocalSwarm, cpu_seconds, vm_rss_mb  # noqa: E402  (bench/local_swarm.py)

MODEL = "smollm2-135m"
SPANS = {"a": (0, 10), "b": (10, 20), "c": (20, 30)}
LAYERS = 30
PROMPT = "What is the capital of France?"
# Public domain (Jane Austen, Pride and Prejudice, 1813): the long prompt's text.
PARAGRAPH = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
             "want of a wife. However little known the feelings or views of such a man may be on his first entering "
             "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
             "considered the rightful property of some one or other of their daughters. ")
LAYER = 0  # the layer whose products the product and layer benchmarks use
WARMUP_PROMPT_TOKENS = 4
TARGETS = {"speedup_vs_naive": 100.0, "rel_err": 1e-3, "prefill_s_per_token": 1.0, "decode_s_per_token_2threads": 3.0}
LIMIT_S = 1200  # every benchmark finishes within 20 minutes
SLACK_S = 30.0  # kept back from LIMIT_S: the report, stopping the nodes
SWARM_RUN_S = 180.0  # a swarm run besides its prefill: nodes started, warm-up (pre-encoding), decode, plaintext
FETCH_S = 90.0  # the first swarm run's fetch benchmark (two fresh consumers fetch the head)
PROMPT_CHUNK = 12  # the private prefill's pipeline chunk (pipeline/client/private_chain.py)
MIN_PROMPT_TOKENS = 36  # three chunks: the pipeline is full for one
WORKER_MARK = b"private_worker"
QWEN05 = dict(vocab_size=256, hidden_size=896, intermediate_size=4864, num_hidden_layers=3, num_attention_heads=14,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.02,
              tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
QWEN_PROMPT = [1, 17, 42, 99, 3, 200, 7, 64, 65, 66]


def median_time(fn, repeats: int, cpu: list | None = None) -> tuple[float, object]:
    """The median wall time of `repeats` calls (and, into `cpu`, the median CPU time
    of this process: what other load on the machine does not inflate)."""
    times, cpu_times, out = [], [], None
    for _ in range(repeats):
        began, cpu_began = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - began)
        cpu_times.append(time.process_time() - cpu_began)
    if cpu is not None:
        cpu.append(statistics.median(cpu_times))
    return statistics.median(times), out


def rel_err(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, dtype=np.float64) - want) / np.linalg.norm(want))


def encrypt(secret, plan, x: np.ndarray) -> list[bytes]:
    return [secret.encrypt(s) for start in range(0, len(x), plan.tokens)
            for s in plan.input_slots(x[start:start + plan.tokens])]


# -- 1. one projection ------------------------------------------------------------------------------


def real_input(model_path: Path, tokenizer):
    prefix = f"model.layers.{LAYER}."
    state = read_tensors(model_path, lambda names: [n for n in names if n == "model.embed_tokens.weight"
                                                   or (n.startswith(prefix) and n.endswith(("_proj.weight",
                                                                                            "input_layernorm.weight")))])
    config = load_config(model_path)
    token = prompt_ids_of(tokenizer, RunRequest(model=MODEL, prompt=PROMPT))[-1]
    embedding = state["model.embed_tokens.weight"][token].float()
    eps = getattr(config, "rms_norm_eps", 1e-5)
    x32 = (embedding * torch.rsqrt(embedding.pow(2).mean() + eps)) * state[f"{prefix}input_layernorm.weight"].float()
    return state, config, x32


def product_bench(state, config, x32, secret, keys, args) -> dict:
    torch.set_num_threads(1)
    weight32 = state[f"model.layers.{LAYER}.self_attn.q_proj.weight"].float()  # [576 out, 576 in]
    weight, x = weight32.double().numpy(), x32.double().numpy()
    plain64 = weight @ x
    rows, cols = weight.shape
    out: dict = {"product": f"{rows}x{cols}", "product_weight": f"SmolLM2-135M layer {LAYER} self_attn.q_proj (real)",
                 "product_input": f"layer {LAYER}'s input for the prompt's last token (real)"}
    plain_s, plain32 = median_time(lambda: weight32 @ x32, 2000)
    out["plain_s"] = plain_s
    out["plain_fp32_rel_err"] = rel_err(plain32.double().numpy(), plain64)
    plan = choose(rows, cols, secret.slots)
    out["plan"] = {"baby": plan.baby, "giant": plan.giant, "outputs": plan.outputs, "products": plan.products}
    out["preencode_s"], encoded = median_time(lambda: EncodedMatrix(secret, weight, plan), 3)
    out["preencode_mb"] = encoded.nbytes / 1e6
    out["plaintexts"] = encoded.plaintexts
    out["encrypt_s"], data = median_time(lambda: encrypt(secret, plan, x[None]), args.repeats)
    out["input_ct_kb"] = len(data[0]) / 1e3
    out["provider_load_s"], cts = median_time(lambda: [secret.ciphertext_from(d) for d in data], args.repeats)
    packed_cpu: list[float] = []
    out["packed_s"], outs = median_time(lambda: encoded.apply(secret, keys, cts), args.repeats, packed_cpu)
    out["packed_cpu_s"] = packed_cpu[0]
    out["provider_dump_s"], out_bytes = median_time(lambda: [secret.dump(outs[o]) for o in sorted(outs)],
                                                    args.repeats)
    out["output_ct_kb"] = sum(len(b) for b in out_bytes) / 1e3
    out["decrypt_s"], packed = median_time(
        lambda: plan.reduce(np.stack([secret.decrypt(b) for b in out_bytes]), 1)[0], args.repeats)
    out["rel_err"] = rel_err(packed, plain64)
    out["on_the_fly_s"], _ = median_time(lambda: EncodedMatrix(secret, weight, plan).apply(secret, keys, cts), 3)
    naive_bench(weight, x, plain64, out, args)
    out["speedup_vs_naive_default_threads"] = out["naive_default_threads_s"] / out["packed_s"]
    out["speedup_vs_naive_cpu"] = out["naive_cpu_s"] / out["packed_cpu_s"]  # CPU seconds, both 1 thread
    out["speedup_vs_naive"] = out["naive_s"] / out["packed_s"]
    out["speedup_vs_on_the_fly"] = out["on_the_fly_s"] / out["packed_s"]
    return out


def naive_bench(weight, x, plain64, out: dict, args) -> None:
    """TenSEAL's CKKSVector.mm, single-threaded like one HE worker, then with
    TenSEAL's default thread count."""
    import tenseal as ts  # noqa: PLC0415

    matrix = weight.T.tolist()  # mm is x @ M: M is [in, out]; outside the timing
    for label, threads in (("naive", 1), ("naive_default_threads", os.cpu_count())):
        ctx = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40, 60],
                         n_threads=threads)
        ctx.global_scale = 2 ** 40
        ctx.generate_galois_keys()
        out["tenseal_context_mb"] = len(ctx.serialize(save_secret_key=False)) / 1e6
        vector = ts.ckks_vector(ctx, x.tolist())
        times, cpu_times = [], []
        for _ in range(args.naive_repeats):
            cpu, began = time.process_time(), time.perf_counter()
            result = vector.mm(matrix)
            times.append(time.perf_counter() - began)
            cpu_times.append(time.process_time() - cpu)
            print(f"  TenSEAL mm, {threads} thread(s): {times[-1]:.2f} s (CPU {cpu_times[-1]:.2f} s)", flush=True)
        out[f"{label}_s"] = statistics.median(times)
        out[f"{label}_cpu_s"] = statistics.median(cpu_times)
        out[f"{label}_threads"] = threads
        out[f"{label}_rel_err"] = rel_err(result.decrypt(), plain64)
        del ctx, vector, result


# -- 2. one layer, decode and prompt plans, 1 and 2 workers, beside the cost model -----------------


def op_times(secret, keys) -> dict[str, float]:
    """This machine's seconds for each kind of operation plan.group_ops counts, as a
    provider's HE worker does them: the cost model's figures, measured here."""
    seal, ev = secret.seal, secret.evaluator
    data = secret.encrypt(np.linspace(-1, 1, secret.slots) * (1 + 0.5j))
    ct = secret.ciphertext_from(data)
    plain = secret.encode(np.full(secret.slots, 0.01 - 0.02j), secret.weight_scale)
    acc, term, out = seal.Ciphertext(), seal.Ciphertext(), seal.Ciphertext()
    ev.multiply_plain(ct, plain, acc)
    low = seal.Ciphertext()
    ev.multiply_plain(ct, plain, low)
    ev.rescale_to_next_inplace(low)
    step = min(s for s in keys_steps(secret, keys) if s > 0)

    def rescale():
        fresh = seal.Ciphertext()
        ev.multiply_plain(ct, plain, fresh)
        ev.rescale_to_next_inplace(fresh)

    def each(fn, n):
        seconds, _ = median_time(lambda: [fn() for _ in range(n)], 5)
        return seconds / n

    times = {"products": each(lambda: (ev.multiply_plain(ct, plain, term), ev.add_inplace(acc, term)), 200),
             "baby_rotations": each(lambda: ev.rotate_vector(ct, step, keys, out), 20),
             "giant_rotations": each(lambda: ev.rotate_vector(low, step, keys, out), 20),
             "inputs": each(lambda: secret.ciphertext_from(data), 20),
             "outputs": each(lambda: secret.dump(low), 20)}
    times["rescales"] = max(0.0, each(rescale, 50) - each(lambda: ev.multiply_plain(ct, plain, term), 200))
    return times


def keys_steps(secret, keys) -> list[int]:
    from compushare.he.ckks import galois_element  # noqa: PLC0415

    return [s for s in range(1, 64) if keys.has_key(galois_element(s, secret.params.poly_degree))]


def predict(plan, threads: int, times: dict[str, float]) -> float:
    """The cost model's seconds for one group on the slowest of `threads` workers."""
    return sum(times[kind] * n for kind, n in plan.ops(threads).items())


def layer_bench(state, config, secret, keys) -> dict:
    op = op_times(secret, keys)
    unit = op["products"]
    out: dict = {"unit_ms": round(unit * 1e3, 4), "op_ms": {k: round(v * 1e3, 4) for k, v in op.items()},
                 "plans": {}}
    rng = np.random.default_rng(0)
    for kind in ("decode", "prompt"):
        share_s = {1: 0.0, 2: 0.0}
        per_group = {}
        predicted = {1: 0.0, 2: 0.0}
        products = 0.0
        for group in GROUPS:
            w = group_weight(state, LAYER, group)
            plan = decode_plan(*w.shape, secret.slots) if kind == "decode" else (
                prompt_plan(*w.shape, secret.slots) or decode_plan(*w.shape, secret.slots))
            out["plans"][f"{kind}_{group}"] = [plan.tokens, plan.baby, plan.giant, plan.chunks, plan.outputs]
            x = rng.normal(0, 1, (plan.tokens, w.shape[1]))
            cts = [secret.ciphertext_from(d) for d in encrypt(secret, plan, x)]
            for threads in (1, 2):
                times = []
                for index in range(threads):
                    matrix = EncodedMatrix(secret, w, plan, (index, threads))
                    seconds, parts = median_time(lambda m=matrix: m.apply(secret, keys, cts), 3)
                    times.append(seconds)
                share_s[threads] += max(times) / plan.tokens
                if threads == 1:
                    per_group[group] = round(max(times) / plan.tokens, 4)
                predicted[threads] += predict(plan, threads, op) / plan.tokens
            products += plan.products * unit / plan.tokens
            if kind == "prompt":
                whole = EncodedMatrix(secret, w, plan).apply(secret, keys, cts)
                got = plan.reduce(np.stack([secret.decrypt(secret.dump(whole[o])) for o in range(plan.outputs)]),
                                  plan.tokens)
                out[f"rel_err_{group}"] = rel_err(got, x @ w.T)
        for threads in (1, 2):
            label = "1thread" if threads == 1 else "2threads"
            out[f"layer_{kind}_s_per_token_{label}"] = share_s[threads]
            out[f"predicted_layer_{kind}_s_per_token_{label}"] = predicted[threads]
        out[f"floor_{kind}_s_per_token_2threads"] = LAYERS * products / 2  # products alone, on both cores
        out[f"layer_{kind}_products_s"] = per_group
    p = secret.params
    out["layer_preencode_mb"] = preencoded_bytes(config, secret.slots, p.poly_degree, len(p.coeff_bits) - 1) / 1e6
    return out


# -- 3. private generation through a swarm -----------------------------------------------------------


class StepLog:
    """Every PrivateChain.step of this process: tokens, wall time, the stats' change,
    and the CPU seconds this process and the HE workers (`pids`) spent in it (what
    other load on the machine does not inflate). Instrumentation only: the step
    itself runs unchanged."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.pids: list[int] = []
        self._original = private_chain.PrivateChain.step

    def workers_cpu(self) -> float:
        total = 0.0
        for pid in self.pids:
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += cpu_seconds(pid)
        return total

    def __enter__(self) -> StepLog:
        original, steps = self._original, self.steps

        async def step(chain, hidden):
            before, began = dataclasses.replace(chain.stats), time.perf_counter()
            cpu, workers = time.process_time(), self.workers_cpu()
            out = await original(chain, hidden)
            after = chain.stats
            steps.append({"tokens": int(hidden.shape[1]), "s": time.perf_counter() - began,
                          "consumer_cpu_s": time.process_time() - cpu, "workers_cpu_s": self.workers_cpu() - workers,
                          **{f.name: getattr(after, f.name) - getattr(before, f.name)
                             for f in dataclasses.fields(after) if isinstance(getattr(after, f.name), (int, float))}})
            return out

        private_chain.PrivateChain.step = step
        return self

    def __exit__(self, *exc) -> None:
        private_chain.PrivateChain.step = self._original


def worker_pids(node_pid: int) -> list[int]:
    """The HE worker processes a node started (children whose command is the worker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == node_pid and WORKER_MARK in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def is_worker(pid: int) -> bool:
    try:
        return WORKER_MARK in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def load_lines(swarm: LocalSwarm) -> dict:
    """What each node's log says its HE workers' load (and pre-encoding) took."""
    pattern = re.compile(r"HE workers \((\d+)\) hold blocks (\d+):(\d+) ?(.*?): (\d+) plaintexts, (\d+) MB, in ([\d.]+)s")
    loads = {}
    for name in swarm.spans:
        log = swarm.root / name / "node.log"
        match = pattern.search(log.read_text(errors="replace") if log.exists() else "")
        if match:
            loads[name] = {"workers": int(match[1]), "blocks": f"{match[2]}:{match[3]}", "how": match[4] or "pre-encoded",
                           "plaintexts": int(match[5]), "mb": int(match[6]), "s": float(match[7])}
    return loads


async def generate_timed(consumer: Consumer, request: RunRequest, timeout_s: float):
    times: list[float] = []
    with trio.fail_after(timeout_s):
        outcome = await consumer.generate(request, on_token=lambda _t: times.append(time.perf_counter()))
    return outcome, times


def start_swarm(root: Path, model: str, spans: dict, threads: int, found_workers: set[int]) -> LocalSwarm:
    swarm = LocalSwarm(root, model, spans)
    for name in spans:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.toml").write_text(f"[limits]\ncompute_threads = {threads}\n")
    swarm.start_all()
    for name in spans:
        found_workers.update(worker_pids(swarm.procs[name].pid))
    return swarm


async def swarm_bench(args, swarm: LocalSwarm, client_dir: Path, threads: int, found_workers: set[int],
                      fetch: bool) -> dict:
    out: dict = {"threads": threads}
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    async with Consumer.connect(client_dir, tuple(swarm.addrs()), MODEL) as consumer:
        consumer.spot_check_rate = 0.0  # one provider per span: no second one to check with
        ids = prompt_ids_of(consumer.tokenizer, RunRequest(model=MODEL, prompt=PARAGRAPH * 8))[:args.prompt_tokens]
        out["prompt_tokens"] = len(ids)
        began = time.perf_counter()
        await consumer._prepare_private()  # secret key, Galois keys, the layers' norms: once per consumer
        out["consumer_setup_s"] = time.perf_counter() - began
        with StepLog() as log:
            warm = RunRequest(model=MODEL, prompt=ids[:WARMUP_PROMPT_TOKENS], private=True,
                              params=SamplingParams(max_new_tokens=1, stop_at_eos=False))
            began = time.perf_counter()
            await generate_timed(consumer, warm, 600)
            out["warmup_s"] = time.perf_counter() - began
            out["provider_load"] = loads = load_lines(swarm)
            for name in swarm.spans:
                found_workers.update(worker_pids(swarm.procs[name].pid))
            out["provider_preencode_mb"] = sum(v["mb"] for v in loads.values()) if loads else None
            print(f"  [{threads} thread(s)] warm-up {out['warmup_s']:.1f} s; HE workers: "
                  + ", ".join(f"{n} {v['workers']} x, {v['mb']} MB in {v['s']:.0f} s" for n, v in loads.items()),
                  flush=True)
            log.steps.clear()
            log.pids = sorted(found_workers)
            private, times = await generate_timed(
                consumer, RunRequest(model=MODEL, prompt=ids, params=params, private=True), 900)
            steps = list(log.steps)
        out["rss_mb"] = {name: {"node_mb": round(vm_rss_mb(swarm.procs[name].pid), 1),
                                "workers_mb": round(sum(vm_rss_mb(w) for w in worker_pids(swarm.procs[name].pid)), 1)}
                         for name in swarm.spans}
        plain, plain_times = await generate_timed(consumer, RunRequest(model=MODEL, prompt=ids, params=params), 300)
    if fetch:
        out.update(await fetch_bench(swarm, swarm.root, ids))
    prefill = [s for s in steps if s["tokens"] > 1]
    decode = [s for s in steps if s["tokens"] == 1]
    decode_steps = len(times) - 1

    def per_token(key: str) -> float:
        return sum(s[key] for s in decode) / max(1, len(decode))

    out.update({
        "prefill_s_per_token": private.first_token_s / len(ids),
        "private_prefill_s": private.first_token_s,
        "prefill_workers_cpu_s_per_token": sum(s["workers_cpu_s"] for s in prefill) / len(ids),
        "prefill_consumer_cpu_s_per_token": sum(s["consumer_cpu_s"] for s in prefill) / len(ids),
        "decode_s_per_token": (times[-1] - times[0]) / decode_steps,
        "decode_steps": decode_steps,
        "new_tokens": len(private.tokens),
        "prefill_provider_s": sum(s["provider_s"] for s in prefill),
        "prefill_workers_cpu_s": sum(s["workers_cpu_s"] for s in prefill),
        "provider_load_s": max((v["s"] for v in out["provider_load"].values()), default=None),
        "consumer_rss_mb": round(vm_rss_mb(os.getpid()), 1),
        "private_totals": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in private.private.items()},
        "per_token": {"encrypt_s": per_token("encrypt_s"), "decrypt_s": per_token("decrypt_s"),
                      "provider_s": per_token("provider_s"),
                      "transfer_s": per_token("roundtrip_s") - per_token("provider_s"),
                      "local_s": per_token("local_s"), "workers_cpu_s": per_token("workers_cpu_s"),
                      "consumer_cpu_s": per_token("consumer_cpu_s")},
        "bytes_sent_per_token": per_token("bytes_sent"),
        "bytes_received_per_token": per_token("bytes_received"),
        "encrypted_projections_per_token": per_token("projections"),
        "keys_mb": private.private["keys_bytes"] / 1e6,
        "tokens": private.tokens, "text": private.text, "plain_tokens": plain.tokens,
        "tokens_match": private.tokens == plain.tokens,
        "plain_s_per_token": (plain_times[-1] - plain_times[0]) / (len(plain_times) - 1),
        "plain_prefill_s": plain.first_token_s,
        "route": [f"{h.start}:{h.end}" for h in private.route], "failovers": len(private.failovers),
    })
    return out


def disk_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


async def fetch_bench(swarm: LocalSwarm, root: Path, ids: list[int]) -> dict:
    """What a consumer holding nothing fetches from the swarm for one private token,
    and for one plaintext token (the head: embeddings, LM head, tokenizer, meta)."""
    model_id = next(iter(swarm.states.values()))["model_id"]
    out = {}
    for label, private in (("consumer_fetch_mb", True), ("head_fetch_mb", False)):
        data_dir = root / f"fetch-{label}"
        async with Consumer.connect(data_dir, tuple(swarm.addrs()), model_id, text_prompts=False) as consumer:
            consumer.spot_check_rate = 0.0
            await generate_timed(consumer, RunRequest(model=model_id, prompt=ids[:WARMUP_PROMPT_TOKENS], private=private,
                                                      params=SamplingParams(max_new_tokens=1, stop_at_eos=False)), 600)
        out[label] = round(disk_mb(data_dir), 3)
    return out


async def qwen_bench(root: Path, found_workers: set[int]) -> dict:
    """A Qwen2.5-0.5B-shaped model (widths past the slots) through 3 providers of 2 HE workers."""
    from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: PLC0415

    torch.manual_seed(0)
    source = root / "qwen05-model"
    AutoModelForCausalLM.from_config(Qwen2Config(**QWEN05)).save_pretrained(str(source))
    spans = {"qa": (0, 1), "qb": (1, 2), "qc": (2, 3)}
    for name in [*spans, "qclient"]:
        import_path(source, root / name, alias="qwen05")
    swarm = start_swarm(root, "qwen05", spans, 2, found_workers)
    try:
        params = SamplingParams(max_new_tokens=4, stop_at_eos=False)
        async with Consumer.connect(root / "qclient", tuple(swarm.addrs()), "qwen05", text_prompts=False) as consumer:
            consumer.spot_check_rate = 0.0
            began = time.perf_counter()
            private, _ = await generate_timed(consumer, RunRequest(model="qwen05", prompt=QWEN_PROMPT, params=params,
                                                                   private=True), 600)
            seconds = time.perf_counter() - began
            plain, _ = await generate_timed(consumer, RunRequest(model="qwen05", prompt=QWEN_PROMPT, params=params),
                                            120)
        return {"qwen05_private_ok": private.tokens == plain.tokens, "qwen05_tokens": private.tokens,
                "qwen05_plain_tokens": plain.tokens, "qwen05_private_s": round(seconds, 1),
                "qwen05_load": load_lines(swarm)}
    finally:
        swarm.close()



# -- report --------------------------------------------------------------------------------------------


def report(p: dict, layer: dict, runs: dict, qwen: dict) -> None:
    print(f"product {p['product']}: {p['product_weight']}; plan {p['plan']}")
    print(f"  naive TenSEAL mm, 1 thread: {p['naive_s']:.3f} s; {p['naive_default_threads_threads']} threads: "
          f"{p['naive_default_threads_s']:.3f} s")
    print(f"  packed, pre-encoded: {p['packed_s'] * 1e3:.1f} ms ({p['speedup_vs_naive']:.0f}x naive, CPU "
          f"{p['speedup_vs_naive_cpu']:.0f}x), rel err {p['rel_err']:.1e}; on the fly {p['on_the_fly_s'] * 1e3:.1f} ms")
    print(f"  consumer: encrypt {p['encrypt_s'] * 1e3:.2f} ms, decrypt + reduce {p['decrypt_s'] * 1e3:.2f} ms; "
          f"keys for {p['rotation_steps']} rotations {p['context_mb']:.1f} MB")
    print(f"layer {LAYER}: operations (ms) {layer['op_ms']}; plans {layer['plans']}")
    for kind in ("decode", "prompt"):
        for label in ("1thread", "2threads"):
            print(f"  {kind}, {label}: {layer[f'layer_{kind}_s_per_token_{label}'] * 1e3:.1f} ms per token "
                  f"(predicted {layer[f'predicted_layer_{kind}_s_per_token_{label}'] * 1e3:.1f}); x {LAYERS} layers = "
                  f"{layer[f'layer_{kind}_s_per_token_{label}'] * LAYERS:.2f} s")
        print(f"  {kind} floor (products alone, 2 threads): {layer[f'floor_{kind}_s_per_token_2threads']:.2f} s/token")
    for threads, s in runs.items():
        t = s["per_token"]
        print(f"swarm, {threads} HE worker(s) per provider: {s['prompt_tokens']} prompt tokens, route {s['route']}")
        print(f"  prefill {s['private_prefill_s']:.1f} s = {s['prefill_s_per_token']:.2f} s/token (HE workers' CPU "
              f"{s['prefill_workers_cpu_s_per_token']:.2f} s/token, consumer's {s['prefill_consumer_cpu_s_per_token']:.2f});"
              f" decode {s['decode_s_per_token']:.2f} s/token; plaintext {s['plain_prefill_s']:.2f} s, "
              f"{s['plain_s_per_token'] * 1e3:.0f} ms/token; tokens match: {s['tokens_match']}")
        print(f"  per decode token: providers {t['provider_s']:.2f} s, transfer {t['transfer_s']:.2f} s, encrypt "
              f"{t['encrypt_s']:.2f} s, decrypt {t['decrypt_s']:.2f} s, local {t['local_s']:.2f} s; CPU: HE workers "
              f"{t['workers_cpu_s']:.2f} s, consumer {t['consumer_cpu_s']:.2f} s; "
              f"{s['bytes_sent_per_token'] / 1e6:.1f} MB sent, {s['bytes_received_per_token'] / 1e6:.1f} MB received")
    for s in runs.values():
        if "consumer_fetch_mb" in s:
            print(f"a consumer holding nothing fetched {s['consumer_fetch_mb']:.1f} MB for a private token, "
                  f"{s['head_fetch_mb']:.1f} MB for a plaintext one (the head)")
    if qwen:
        print(f"qwen05 (3 layers of Qwen2.5-0.5B's widths): private tokens {qwen['qwen05_tokens']}, plaintext "
              f"{qwen['qwen05_plain_tokens']}: ok {qwen['qwen05_private_ok']} in {qwen['qwen05_private_s']} s")


def summary(p: dict, layer: dict, runs: dict, qwen: dict) -> dict:
    r = lambda v, n=3: round(v, n) if isinstance(v, float) else v  # noqa: E731
    result = {k: r(p[k], 5) for k in ("naive_s", "packed_s", "on_the_fly_s", "preencode_s", "preencode_mb",
                                      "encrypt_s", "decrypt_s", "provider_dump_s", "speedup_vs_naive",
                                      "speedup_vs_on_the_fly", "context_mb", "rotation_steps", "tenseal_context_mb",
                                      "naive_cpu_s", "naive_default_threads_s", "naive_default_threads_threads",
                                      "naive_default_threads_cpu_s", "naive_threads",
                                      "speedup_vs_naive_default_threads", "packed_cpu_s", "speedup_vs_naive_cpu",
                                      "plain_s", "product")}
    result["input_parse_s"] = r(p["provider_load_s"], 5)
    result["rel_err"] = float(f"{p['rel_err']:.3g}")
    result["naive_rel_err"] = float(f"{p['naive_rel_err']:.3g}")
    result.update({k: r(v, 4) for k, v in layer.items() if k not in ("plans", "op_ms")})
    result["plans"], result["op_ms"] = layer["plans"], layer["op_ms"]
    # today's names (revision 23's bench) for the decode plan on one worker
    result["layer_product_s"] = round(layer["layer_decode_s_per_token_1thread"], 4)
    result["layer_products_s"] = layer["layer_decode_products_s"]
    for threads, s in runs.items():
        label = "1thread" if threads == 1 else "2threads"
        for key in ("prefill_s_per_token", "decode_s_per_token"):
            result[f"{key}_{label}"] = round(s[key], 3)
        result[f"predicted_prefill_s_per_token_{label}"] = round(layer[f"predicted_layer_prompt_s_per_token_{label}"]
                                                                 * LAYERS, 3)
        result[f"predicted_decode_s_per_token_{label}"] = round(layer[f"predicted_layer_decode_s_per_token_{label}"]
                                                                * LAYERS, 3)
        result[f"tokens_match_{label}"] = s["tokens_match"]
        # A healthy run fails no provider over and reopens no session (protocol 2.1.0's waits).
        result[f"failovers_{label}"] = s["failovers"]
        result[f"reopened_{label}"] = s["private_totals"].get("reopened", 0)
        result[f"per_token_{label}"] = {k: round(v, 3) for k, v in s["per_token"].items()}
        result[f"prefill_workers_cpu_s_per_token_{label}"] = round(s["prefill_workers_cpu_s_per_token"], 3)
    best = runs.get(max(runs)) if runs else None
    if best:
        fastest = min(runs.values(), key=lambda s: s["prefill_s_per_token"])
        result.update({
            "prefill_s_per_token": round(fastest["prefill_s_per_token"], 3),
            "prefill_threads": fastest["threads"],
            "private_s_per_token": round(best["decode_s_per_token"], 3),
            "private_prefill_s": round(best["private_prefill_s"], 1),
            "prompt_tokens": best["prompt_tokens"], "decode_steps": best["decode_steps"],
            "tokens_match": all(s["tokens_match"] for s in runs.values()),
            "encrypted_projections_per_token": best["encrypted_projections_per_token"],
            "bytes_sent_per_token": int(best["bytes_sent_per_token"]),
            "bytes_received_per_token": int(best["bytes_received_per_token"]),
            "plain_s_per_token": round(best["plain_s_per_token"], 4),
            "keys_mb": round(best["keys_mb"], 1), "failovers": best["failovers"],
            "provider_preencode_mb": best["provider_preencode_mb"],
            "rss_mb": best["rss_mb"], "warmup_s": round(best["warmup_s"], 1),
            "per_token": {k: round(v, 3) for k, v in best["per_token"].items()},
            "new_tokens": best["new_tokens"], "prefill_provider_s": round(best["prefill_provider_s"], 1),
            "prefill_workers_cpu_s": round(best["prefill_workers_cpu_s"], 1),
            "consumer_setup_s": round(best["consumer_setup_s"], 1), "provider_load_s": best["provider_load_s"],
            "worker_rss_mb": {n: r["workers_mb"] for n, r in best["rss_mb"].items()},
            "node_rss_mb": {n: r["node_mb"] for n, r in best["rss_mb"].items()},
            "consumer_rss_mb": best["consumer_rss_mb"], "private_totals": best["private_totals"],
        })
        one = runs.get(1)
        if one:  # what the HE worker reports per layer and token (parsing and serialising included)
            result["layer_worker_s"] = round(one["per_token"]["provider_s"] / LAYERS, 4)
    for s in runs.values():
        for key in ("consumer_fetch_mb", "head_fetch_mb"):
            if key in s:
                result[key] = s[key]
    result.update({k: v for k, v in qwen.items() if k != "qwen05_load"})
    met = {"speedup_vs_naive": result["speedup_vs_naive"] >= TARGETS["speedup_vs_naive"],
           "rel_err": p["rel_err"] <= TARGETS["rel_err"],
           "prefill_s_per_token": result.get("prefill_s_per_token", 1e9) <= TARGETS["prefill_s_per_token"],
           "decode_s_per_token_2threads": result.get("decode_s_per_token_2threads", 1e9)
           <= TARGETS["decode_s_per_token_2threads"],
           "tokens_match": bool(result.get("tokens_match")), "qwen05_private_ok": bool(qwen.get("qwen05_private_ok")),
           "consumer_fetch_mb": result.get("consumer_fetch_mb", 1e9) <= result.get("head_fetch_mb", 0) + 1.0}
    result["targets"] = met
    result["targets_met"] = all(met.values())
    return result


def fitted_prompt(wanted: int, layer: dict, runs: int, left_s: float) -> int:
    """The swarm runs' prompt length: `wanted`, or fewer where this machine's measured
    layer time says the runs' prefills would not fit `left_s` (a slower machine than
    the one the default was set on: a 2-vCPU Xeon needs about 1,600 s for 128). A
    prefill token costs each run about LAYERS x one worker's layer time a prompt token
    (the three providers share the cores; measured 0.7-0.8 of it on 2 vCPUs)."""
    if runs == 0:
        return wanted
    per_token = LAYERS * layer["layer_prompt_s_per_token_1thread"] * runs
    spare = left_s - runs * SWARM_RUN_S - FETCH_S
    fits = int(max(0.0, spare) / per_token) // PROMPT_CHUNK * PROMPT_CHUNK
    return max(MIN_PROMPT_TOKENS, min(wanted, fits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="runs of the packed product (the median)")
    parser.add_argument("--naive-repeats", type=int, default=2, help="runs of TenSEAL's mm (the median)")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--threads", default="1,2", help="HE workers per provider, one swarm run each")
    parser.add_argument("--no-swarm", action="store_true", help="the product and layer benchmarks only")
    parser.add_argument("--no-qwen", action="store_true", help="without the Qwen2.5-0.5B-shaped run")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    began = time.monotonic()
    load_before = os.getloadavg()[0]
    print(f"load average at the start: {load_before:.2f} on {os.cpu_count()} CPUs", flush=True)
    runs: dict[int, dict] = {}
    unfinished: list[int] = []
    qwen: dict = {}
    found_workers: set[int] = set()
    swarms: list[LocalSwarm] = []
    with tempfile.TemporaryDirectory(prefix="compushare-he-") as tmp:
        root = Path(tmp)
        try:
            client_dir = root / "client"
            model = resolve_model(MODEL, client_dir)  # converts SmolLM2 once into the shared cache
            state, config, x32 = real_input(model.path, load_tokenizer(model))
            secret = SecretContext()
            steps = required_steps(config, secret.slots)
            keys_bytes = secret.galois_keys(steps)
            keys = secret.galois_keys_from(keys_bytes, steps)
            print("product benchmark (576 x 576, one token)", flush=True)
            product = product_bench(state, config, x32, secret, keys, args)
            product.update(context_mb=len(keys_bytes) / 1e6, rotation_steps=len(steps))
            print(f"[{time.monotonic() - began:.0f} s] layer benchmark (4 products, decode and prompt plans, "
                  "1 and 2 workers)", flush=True)
            layer = layer_bench(state, config, secret, keys)
            del state, secret, keys
            if not args.no_qwen:  # first: a check of private mode past the slots, whatever time is left after
                print(f"[{time.monotonic() - began:.0f} s] Qwen2.5-0.5B-shaped model, privately", flush=True)
                qwen = trio.run(qwen_bench, root / "qwen", found_workers)
            thread_runs = [] if args.no_swarm else [int(t) for t in args.threads.split(",")]
            wanted = args.prompt_tokens
            args.prompt_tokens = fitted_prompt(wanted, layer, len(thread_runs),
                                               LIMIT_S - SLACK_S - (time.monotonic() - began))
            if args.prompt_tokens < wanted:
                print(f"  prompt cut to {args.prompt_tokens} tokens (of {wanted}): this machine's layer time says "
                      f"{wanted} would not fit {LIMIT_S} s", flush=True)
            for threads in thread_runs:
                print(f"[{time.monotonic() - began:.0f} s] swarm, {threads} HE worker(s) a provider", flush=True)
                swarm = start_swarm(root / f"t{threads}", MODEL, SPANS, threads, found_workers)
                swarms.append(swarm)

                async def bounded(swarm=swarm, threads=threads):
                    with trio.fail_after(max(60.0, LIMIT_S - SLACK_S - (time.monotonic() - began))):
                        return await swarm_bench(args, swarm, client_dir, threads, found_workers, fetch=not runs)

                try:
                    runs[threads] = trio.run(bounded)
                except trio.TooSlowError:  # what was measured is still reported, this run marked missing
                    print(f"  swarm run with {threads} worker(s) stopped: past the {LIMIT_S} s limit", flush=True)
                    unfinished.append(threads)
                swarm.close()
        finally:
            for swarm in swarms:
                for proc in swarm.procs.values():
                    if proc.poll() is None:
                        found_workers.update(worker_pids(proc.pid))
                swarm.close()
            # A node ends its HE workers when it stops; one that was killed leaves them to
            # exit on their closed stdin. Whatever is still there is ended here, by pid.
            for pid in found_workers:
                if is_worker(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    report(product, layer, runs, qwen)
    load_after = os.getloadavg()[0]
    print(f"total {time.monotonic() - began:.0f} s; load average at the end {load_after:.2f}", flush=True)
    result = summary(product, layer, runs, qwen)
    result["load_avg"] = [round(load_before, 2), round(load_after, 2)]
    result["total_s"] = round(time.monotonic() - began, 1)
    result["prompt_tokens_wanted"] = wanted if not args.no_swarm else None
    result["unfinished_runs"] = unfinished
    result["within_limit"] = result["total_s"] <= LIMIT_S
    print(json.dumps(result))


if __name__ == "__main__":
    main()
