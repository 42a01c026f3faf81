"""Per-node compute of each weight format, side by side in one run, and llama.cpp on the same GGUF.

    .venv/bin/python bench/node_compute.py [--tokens 64] [--trials 3] [--ppl-tokens 2048]
                                           [--formats fp32,bf16,int8,q4,gguf_native,ggml] [--skip-llamacpp]

SmolLM2-135M (30 blocks) in every weight format a node can serve, all in this process
at once, one torch thread (torch.set_num_threads(1)), the whole model per format: its
30 blocks as one model/blocks.SpanRunner plus its model/head.ConsumerHead (the lean
path a node and a consumer run, no network). Formats, each its own model in a
temporary data dir (removed on every exit path; the shared conversion cache is
$COMPUSHARE_CACHE, default ~/.cache/compushare):

  fp32         smollm2-135m          the reference (itself the GGUF's Q4_1 dequantized)
  bf16         smollm2-135m@bf16
  int8         smollm2-135m@int8     our quantizer, per-row int8
  q4           smollm2-135m@q4       our quantizer from the fp32 weights: q, o, gate, up in
                                     4 bits, groups of 64 (scale and min searched for the
                                     least squared error), k, v, down and the head at int8
  gguf_native  smollm2-135m@gguf     the GGUF file's own blocks kept (gguf: Q4_1, all 4-bit)
  ggml         smollm2-135m@gguf     the same blocks on the ggml runtime (spans/ggml: llama.cpp's
                                     engine and graph), with the head on ggml too
  q4_g32       smollm2-135m@q4/g32   only with --formats: our quantizer at group 32. Its
                                     4-bit matrices recover the GGUF's grid exactly (the run
                                     checks block 0's), so its quality is not a test of the
                                     quantizer: the q4 targets are measured at group 64.

decode    greedy (argmax), decode only: prefill the chat prompt PROMPTS[0], its logits
          give token 0, then `--tokens` single-token steps through all 30 blocks and the
          head give tokens 1..N; tok/s = N / (time of token N - time of token 0). One
          untimed warm-up per format (8 tokens), then `--trials` trials with the formats
          interleaved (fp32, bf16, ..., fp32, bf16, ...); the median is reported.
          Contention (this machine is shared): the 1-minute load average before and
          after the trials, and per format the lowest CPU share of a timed decode
          (process CPU time / wall time; < 1 when the thread waited for a CPU). A
          warning is printed when other work evidently ran during the trials.
prefill   one forward of a 256-token prompt (the first 256 tokens of the text below) on
          a fresh cache, blocks + the last position's logits; one warm-up, then the
          median of `--trials` interleaved trials. tok/s = 256 / time.
bytes     a block's stored bytes including scales / minimums (manifest block_bytes;
          every block of SmolLM2 is the same size, checked), and the ratio to fp32.
          `weight_bytes_per_block` is what the loaded span holds in memory per block.
quality   five chat prompts (PROMPTS), `--tokens` greedy tokens t_0..t_{N-1} per format,
          generated freely (each format continues its own tokens), against fp32's:
          agree_<fmt>     = mean over prompts of (common prefix length with fp32) / N,
                            i.e. how far a format follows fp32 before its first
                            different token (1.0 = all N tokens identical);
          first_diff      = per prompt, the index of the first token that differs
                            (null = none);
          tf_agree_<fmt>  = teacher-forced top-1 agreement: the prompt followed by
                            fp32's tokens t_0..t_{N-2} in one forward (fresh cache);
                            the fraction of the N positions whose argmax is fp32's
                            token t_i, over all prompts. fp32 itself is included: a
                            multi-row forward rounds differently from one-token steps,
                            so its value is the floor of what "identical" can mean;
          kl_<fmt>        = mean KL(fp32 || format) of the next-token distributions at
                            those teacher-forced positions (nats, float64).
ppl       bench/data/pd_english.txt (Alice's Adventures in Wonderland, ch. I-III; public
          domain) tokenized without special tokens, its first `--ppl-tokens` tokens (all
          of it if shorter), cut into non-overlapping 512-token windows, each evaluated
          in one forward on a fresh cache; every position but each window's first is
          predicted (head.logits_rows), ppl = exp(mean NLL), log-softmax in float64.
          The same tokens for every format.
llama.cpp bench/llamacpp_ref.py (llama-cpp-python built from its sdist once into a
          scratch venv, cached; 1 thread): the same GGUF, the same chat-prompt ids,
          greedy decode of `--tokens` steps timed the same way (decode_tok_s), and the
          same 256 prefill ids (prefill_tok_s). Whether its build happened in this run
          (and its compile seconds) is reported. The bench calls ensure_llamacpp()
          before loading anything, so a build never overlaps a measurement.

Targets: q4 decode >= 1.5x fp32; q4 decode >= 0.5x llama.cpp; q4 block bytes <= 0.2x
fp32; ppl(q4) <= 1.10 x ppl(fp32); ppl(int8) <= 1.02 x ppl(fp32).

Human-readable lines first; the last line is one JSON object, also appended (with run,
date and commit) to bench/results/node_compute.jsonl (--results '' skips that).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, finish  # noqa: E402  (this checkout's src/, the shared caches)
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

from compushare.config import resolve_cache_dir  # noqa: E402
from compushare.model.blocks import SpanRunner  # noqa: E402
from compushare.model.catalog import resolve_model  # noqa: E402
from compushare.model.head import ConsumerHead  # noqa: E402
from compushare.spans import load_head, load_span  # noqa: E402
from compushare.model.sources import smollm2_gguf  # noqa: E402

MODEL = "smollm2-135m"
FORMATS = {  # key -> model name
    "fp32": MODEL,
    "bf16": f"{MODEL}@bf16",
    "int8": f"{MODEL}@int8",
    "q4": f"{MODEL}@q4",
    "gguf_native": f"{MODEL}@gguf",
    "q4_g32": f"{MODEL}@q4/g32",
    "ggml": f"{MODEL}@gguf",
}
RUNTIMES = {"ggml": "ggml"}  # formats computed by the ggml runtime (the rest: torch)
DEFAULT_FORMATS = ("fp32", "bf16", "int8", "q4", "gguf_native", "ggml")
PROMPTS = [
    "What is the capital of France, and what is it known for?",
    "Write a short poem about the sea at night.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "List three tips for learning a new language, with one sentence each.",
    "Write a Python function that returns the n-th Fibonacci number.",
]
TEXT = REPO / "bench" / "data" / "pd_english.txt"
PPL_WINDOW = 512
PREFILL_TOKENS = 256
WARMUP_TOKENS = 8
TARGETS = {
    "q4_vs_fp32": (">=", 1.5),
    "q4_vs_llamacpp": (">=", 0.5),
    "ggml_vs_llamacpp": (">=", 0.95),
    "q4_bytes_vs_fp32": ("<=", 0.2),
    "ppl_q4_vs_fp32": ("<=", 1.10),
    "ppl_int8_vs_fp32": ("<=", 1.02),
}


def log(text: str = "") -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------- cleanup


TMP_PREFIX = "compushare-node-compute-"
OWNER_FILE = ".owner-pid"


class Cleanup:
    """The temporary data dir (the model store); removed from `finally`, atexit and on
    SIGTERM/SIGHUP/SIGINT (those raise, so the `finally` runs). Idempotent. A run that
    was SIGKILLed cannot clean up: the next run removes such leftovers (a dir of ours
    whose owner pid is gone)."""

    def __init__(self) -> None:
        self._sweep()
        self.tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
        (self.tmp / OWNER_FILE).write_text(str(os.getpid()))
        self._done = False
        atexit.register(self.run)

    @staticmethod
    def _sweep() -> None:
        for old in Path(tempfile.gettempdir()).glob(TMP_PREFIX + "*"):
            try:
                pid = int((old / OWNER_FILE).read_text())
                os.kill(pid, 0)
            except ProcessLookupError:
                shutil.rmtree(old, ignore_errors=True)
            except (OSError, ValueError):
                pass  # no owner file yet (a run starting up) or not ours to judge

    def run(self) -> None:
        if self._done:
            return
        self._done = True
        shutil.rmtree(self.tmp, ignore_errors=True)


def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


# --------------------------------------------------------------------------- machine


def machine_info() -> dict:
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "torch_threads": torch.get_num_threads()}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# --------------------------------------------------------------------------- formats


class Loaded:
    def __init__(self, key: str, model, runner: SpanRunner, head: ConsumerHead) -> None:
        self.key, self.model, self.runner, self.head = key, model, runner, head

    def argmax_last(self, hidden: torch.Tensor) -> int:
        return int(torch.argmax(self.head.logits(hidden)))

    def decode(self, ids: list[int], steps: int) -> tuple[list[int], float, list[float]]:
        """Prefill `ids`, token 0 from its logits, then `steps` one-token steps: the
        steps + 1 greedy tokens, the time from token 0 to token `steps`, and each step's time."""
        runner, head = self.runner, self.head
        cache = runner.new_cache()
        hidden = runner.forward(head.embed_tokens(ids), cache, 0)
        token = self.argmax_last(hidden)
        tokens, step_s = [token], []
        position = len(ids)
        cpu0 = time.process_time()
        t0 = last = time.perf_counter()
        for _ in range(steps):
            hidden = runner.forward(head.embed_tokens([token]), cache, position)
            position += 1
            token = self.argmax_last(hidden)
            tokens.append(token)
            now = time.perf_counter()
            step_s.append(now - last)
            last = now
        self.cpu_share = (time.process_time() - cpu0) / (last - t0) if last > t0 else 1.0
        return tokens, last - t0, step_s

    def prefill(self, ids: list[int]) -> float:
        began = time.perf_counter()
        hidden = self.runner.forward(self.head.embed_tokens(ids), self.runner.new_cache(), 0)
        self.argmax_last(hidden)
        return time.perf_counter() - began

    def rows(self, ids: list[int]) -> torch.Tensor:
        """Logits of every position of `ids` in one forward on a fresh cache: [n, vocab]."""
        hidden = self.runner.forward(self.head.embed_tokens(ids), self.runner.new_cache(), 0)
        return self.head.logits_rows(hidden)


def load_formats(keys: list[str], data_dir: Path) -> tuple[dict[str, Loaded], dict]:
    loaded, info = {}, {}
    for key in keys:
        began = time.perf_counter()
        model = resolve_model(FORMATS[key], data_dir)
        runtime = RUNTIMES.get(key, "torch")
        runner = load_span(model.path, 0, model.num_blocks, runtime=runtime, threads=1)
        head = load_head(model.path, runtime=runtime)
        block_bytes = model.manifest.block_bytes()
        loaded[key] = Loaded(key, model, runner, head)
        info[key] = {
            "model": FORMATS[key], "model_id": model.model_id[:16], "label": model.format.label,
            "block_bytes": block_bytes[0], "blocks_equal": len(set(block_bytes.values())) == 1,
            "weight_bytes_per_block": runner.weight_bytes // model.num_blocks,
            "compute_dtype": str(runner.dtype).removeprefix("torch."),
            "load_s": round(time.perf_counter() - began, 1),
        }
        log(f"  {key:12} {FORMATS[key]:22} {model.format.label:7} id {model.model_id[:12]}  block "
            f"{block_bytes[0]:>10,} B  (loaded in {info[key]['load_s']} s)")
    return loaded, info


# --------------------------------------------------------------------------- measurements


def measure_decode(loaded: dict[str, Loaded], ids: list[int], tokens: int, trials: int) -> dict:
    for fmt in loaded.values():  # warm-up: page in the weights, first-call allocations
        fmt.decode(ids, WARMUP_TOKENS)
    runs: dict[str, list] = {key: [] for key in loaded}
    shares: dict[str, list[float]] = {key: [] for key in loaded}
    for _ in range(trials):
        for key, fmt in loaded.items():
            runs[key].append(fmt.decode(ids, tokens))
            shares[key].append(fmt.cpu_share)
    out = {}
    for key, rs in runs.items():
        tok_s = [tokens / elapsed for _, elapsed, _ in rs]
        out[key] = {
            "tok_s": statistics.median(tok_s),
            "tok_s_trials": [round(v, 2) for v in tok_s],
            "step_ms_median": 1000 * statistics.median(s for _, _, steps in rs for s in steps),
            "tokens": rs[-1][0],
            "stable": all(r[0] == rs[0][0] for r in rs),
            "cpu_share_min": min(shares[key]),
        }
    return out


def measure_prefill(loaded: dict[str, Loaded], ids: list[int], trials: int) -> dict:
    for fmt in loaded.values():
        fmt.prefill(ids)
    times: dict[str, list[float]] = {key: [] for key in loaded}
    for _ in range(trials):
        for key, fmt in loaded.items():
            times[key].append(fmt.prefill(ids))
    return {key: len(ids) / statistics.median(ts) for key, ts in times.items()}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure_quality(loaded: dict[str, Loaded], prompts: list[list[int]], tokens: int) -> dict:
    """Free-running greedy agreement with fp32, teacher-forced top-1 agreement and KL."""
    free = {key: [fmt.decode(ids, tokens - 1)[0] for ids in prompts] for key, fmt in loaded.items()}
    ref_tokens = free["fp32"]
    ref_logp = []
    for ids, seq in zip(prompts, ref_tokens):
        rows = loaded["fp32"].rows(ids + seq[:-1])[len(ids) - 1:]
        ref_logp.append(torch.log_softmax(rows.double(), dim=-1))
    out = {}
    for key, fmt in loaded.items():
        prefixes = [common_prefix(seq, ref) for seq, ref in zip(free[key], ref_tokens)]
        positional = sum(x == y for seq, ref in zip(free[key], ref_tokens) for x, y in zip(seq, ref))
        hits = kl_sum = 0.0
        count = 0
        for ids, seq, ref_lp in zip(prompts, ref_tokens, ref_logp):
            rows = fmt.rows(ids + seq[:-1])[len(ids) - 1:]
            lp = torch.log_softmax(rows.double(), dim=-1)
            target = torch.tensor(seq)
            hits += int((torch.argmax(rows, dim=-1) == target).sum())
            kl_sum += float((ref_lp.exp() * (ref_lp - lp)).sum())
            count += len(seq)
        out[key] = {
            "agree": statistics.mean(p / tokens for p in prefixes),
            "first_diff": [p if p < tokens else None for p in prefixes],
            "agree_positional": positional / (tokens * len(prompts)),
            "tf_agree": hits / count,
            "kl": kl_sum / count,
        }
    return out, free


def same_4bit_matrices(ours: Path, theirs: Path) -> bool:
    """Whether every matrix block 0 of `ours` holds in 4 bits equals the GGUF model
    `theirs`'s own (its blocks dequantized), value for value."""
    from safetensors.torch import load_file

    from compushare.model.quantize import dequantize, matrix_parts
    from compushare.model.weights import read_dense_tensors

    a = load_file(str(Path(ours) / "block-0000.safetensors"))
    b = read_dense_tensors(theirs, lambda names: [n for n in names if n.startswith("model.layers.0.")])
    four_bit = [name.removesuffix("_min") for name in a if name.endswith("_min")]
    return bool(four_bit) and all(torch.equal(dequantize(matrix_parts(a, n)), b[n]) for n in four_bit)


def measure_ppl(loaded: dict[str, Loaded], ids: list[int]) -> dict:
    windows = [ids[i:i + PPL_WINDOW] for i in range(0, len(ids), PPL_WINDOW)]
    windows = [w for w in windows if len(w) >= 2]
    out = {}
    for key, fmt in loaded.items():
        nll, count = 0.0, 0
        for window in windows:
            rows = fmt.rows(window)[:-1].double()
            logp = torch.log_softmax(rows, dim=-1)
            target = torch.tensor(window[1:])
            nll -= float(logp.gather(1, target.unsqueeze(1)).sum())
            count += len(window) - 1
        out[key] = {"ppl": math.exp(nll / count), "predicted": count}
    return out


# --------------------------------------------------------------------------- llama.cpp


def llamacpp_build() -> dict:
    """ensure_llamacpp() before any measurement: builds once (cached) or reuses."""
    import llamacpp_ref

    before = llamacpp_ref.build_info()
    began = time.perf_counter()
    llamacpp_ref.ensure_llamacpp()
    ensure_s = time.perf_counter() - began
    info = llamacpp_ref.build_info() or {}
    built_now = before is None or before.get("built_at") != info.get("built_at")
    return {"build": info.get("variant"), "build_s": info.get("build_s"), "build_total_s": info.get("total_s"),
            "built_in_this_run": built_now, "ensure_s": round(ensure_s, 1), "version": info.get("version"),
            "built_at": info.get("built_at"), "venv": str(llamacpp_ref.cache_dir() / "venv")}


def llamacpp_measure(gguf: Path, chat_ids: list[int], prefill_ids: list[int], tokens: int, trials: int) -> dict:
    import llamacpp_ref

    dec = llamacpp_ref.measure_llamacpp(gguf, prompt_tokens=chat_ids, decode_tokens=tokens, trials=trials)
    pre = llamacpp_ref.measure_llamacpp(gguf, prompt_tokens=prefill_ids, decode_tokens=0, trials=trials)
    return {"decode_tok_s": dec["decode_tok_s"], "prefill_tok_s": pre["prefill_tok_s"],
            "prefill_chat_tok_s": dec["prefill_tok_s"], "tokens": dec["tokens"],
            "decode_trials_s": dec.get("trials_decode_s"), "version": dec.get("version"),
            "build": dec.get("build"), "build_s": dec.get("build_s"), "system_info": dec.get("system_info")}


# --------------------------------------------------------------------------- main


def _r(value, digits=3):
    return None if value is None else round(value, digits)


def run(args: argparse.Namespace, cleanup: Cleanup) -> dict:
    from transformers import AutoTokenizer

    began = time.perf_counter()
    keys = [k.strip() for k in args.formats.split(",") if k.strip()]
    unknown = [k for k in keys if k not in FORMATS]
    if unknown or "fp32" not in keys:
        raise SystemExit(f"--formats: one of {', '.join(FORMATS)}, fp32 included (got {args.formats})")
    machine = machine_info()
    log(f"node compute: {MODEL}, formats {', '.join(keys)}; 1 torch thread; {machine['cpu']} "
        f"({machine['cpus']} CPUs), torch {machine['torch']}")

    gguf = smollm2_gguf(resolve_cache_dir())
    llama_build = None
    if not args.skip_llamacpp:
        log("llama.cpp: ensure_llamacpp() (builds once into a scratch venv, else reuses) ...")
        try:
            llama_build = llamacpp_build()
            log(f"  {'built in this run' if llama_build['built_in_this_run'] else 'reused'}: variant "
                f"{llama_build['build']}, compile {llama_build['build_s']} s (total {llama_build['build_total_s']} s), "
                f"llama-cpp-python {llama_build['version']}; {llama_build['venv']}")
        except Exception as exc:  # the rest of the bench still runs
            llama_build = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            log(f"  llama.cpp unavailable: {llama_build['error']}")

    log(f"loading into {cleanup.tmp}:")
    loaded, info = load_formats(keys, cleanup.tmp)
    same_grid = None
    if "gguf_native" in keys:  # q4/g32 from our quantizer: the GGUF's own 4-bit weights again?
        same_grid = same_4bit_matrices(resolve_model(FORMATS["q4_g32"], cleanup.tmp).path,
                                       loaded["gguf_native"].model.path)
        log(f"  our quantizer's 4-bit matrices at group 32 {'are' if same_grid else 'are NOT'} the GGUF's own, "
            f"byte for byte (block 0): at g32 the quantizer merely finds the file's grid again")
    tokenizer = AutoTokenizer.from_pretrained(str(loaded["fp32"].model.path))
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=False), add_special_tokens=False)["input_ids"]
               for p in PROMPTS]
    text_ids = tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ppl_ids = text_ids[:args.ppl_tokens]
    prefill_ids = text_ids[:PREFILL_TOKENS]
    chat_ids = prompts[0]

    torch.set_num_threads(1)
    log(f"decode: {args.tokens} steps after token 0, prompt of {len(chat_ids)} tokens, {args.trials} trials "
        f"interleaved ...")
    load_before = os.getloadavg()[0]
    decode = measure_decode(loaded, chat_ids, args.tokens, args.trials)
    load_after = os.getloadavg()[0]
    log(f"prefill: {len(prefill_ids)} tokens, {args.trials} trials interleaved ...")
    prefill = measure_prefill(loaded, prefill_ids, args.trials)
    log(f"quality: {len(prompts)} prompts x {args.tokens} greedy tokens ...")
    quality, free = measure_quality(loaded, prompts, args.tokens)
    log(f"perplexity: {len(ppl_ids)} tokens of {TEXT.name}, {PPL_WINDOW}-token windows ...")
    ppl = measure_ppl(loaded, ppl_ids)

    llama = None
    if llama_build is not None and "error" not in llama_build:
        log("llama.cpp: measuring (1 thread) ...")
        try:
            llama = llamacpp_measure(gguf, chat_ids, prefill_ids, args.tokens, args.trials)
        except Exception as exc:
            llama = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            log(f"  llama.cpp measurement failed: {llama['error']}")
    llama_ok = llama is not None and "error" not in llama

    # ------------------------------------------------------------------ report
    fp32_bytes = info["fp32"]["block_bytes"]
    log("")
    log(f"{'format':12} {'decode':>9} {'step':>8} {'prefill':>9} {'block bytes':>12} {'x fp32':>7} "
        f"{'ppl':>8} {'agree':>6} {'tf':>6} {'KL':>9}  first differing token per prompt")
    for key in keys:
        q = quality[key]
        log(f"{key:12} {decode[key]['tok_s']:7.1f}/s {decode[key]['step_ms_median']:6.1f}ms "
            f"{prefill[key]:7.1f}/s {info[key]['block_bytes']:>12,} {info[key]['block_bytes'] / fp32_bytes:7.3f} "
            f"{ppl[key]['ppl']:8.3f} {q['agree']:6.3f} {q['tf_agree']:6.3f} {q['kl']:9.2e}  "
            f"{['-' if d is None else d for d in q['first_diff']]}")
    if llama_ok:
        log(f"{'llama.cpp':12} {llama['decode_tok_s']:7.1f}/s {1000 / llama['decode_tok_s']:6.1f}ms "
            f"{llama['prefill_tok_s']:7.1f}/s   (the GGUF: Q4_1 blocks; {llama['build']} build of "
            f"llama-cpp-python {llama['version']})")
    log("decode trials (tok/s): " + "; ".join(f"{k} {decode[k]['tok_s_trials']}" for k in keys))
    share = min(decode[k]["cpu_share_min"] for k in keys)
    log(f"contention: 1-min load average {load_before:.2f} before the decode trials, {load_after:.2f} after "
        f"(this process alone adds ~1); lowest CPU share of a timed decode {share:.3f} (CPU time / wall time)")
    if share < 0.95 or load_after > 1.8:
        log("WARNING: other work was running on this machine during the decode trials: the tok/s above are "
            "depressed and noisy")
    unstable = [k for k in keys if not decode[k]["stable"]]
    if unstable:
        log(f"WARNING: greedy tokens differ between trials for {unstable}")
    log("agree = common prefix with fp32's free-running greedy tokens / N (mean of prompts); tf = teacher-forced "
        "top-1 agreement; KL = mean KL(fp32 || format), nats")
    log(f"ppl: {ppl['fp32']['predicted']} predicted tokens in non-overlapping {PPL_WINDOW}-token windows")
    for key in keys:
        if key != "fp32":
            first = free[key][0]
            log(f"  prompt 0, {key}: {tokenizer.decode(first[:24])!r}")
    log(f"  prompt 0, fp32: {tokenizer.decode(free['fp32'][0][:24])!r}")
    if llama_ok:
        ref = decode.get("gguf_native", decode["fp32"])["tokens"]
        log(f"  llama.cpp: {tokenizer.decode(llama['tokens'][:24])!r}")
        log(f"llama.cpp greedy tokens vs {'gguf_native' if 'gguf_native' in decode else 'fp32'} (same prompt ids): "
            f"common prefix {common_prefix(llama['tokens'], ref)} of {len(ref)}; vs fp32 "
            f"{common_prefix(llama['tokens'], decode['fp32']['tokens'])}")

    def ratio(a, b):
        return None if a is None or b is None or not b else a / b

    tok = {k: decode[k]["tok_s"] for k in keys}
    result: dict = {}
    for key in keys:
        result[f"{key}_tok_s"] = _r(tok[key], 2)
    result["llamacpp_tok_s"] = _r(llama["decode_tok_s"], 2) if llama_ok else None
    q4 = tok.get("q4")
    result["q4_vs_fp32"] = _r(ratio(q4, tok["fp32"]))
    result["int8_vs_fp32"] = _r(ratio(tok.get("int8"), tok["fp32"]))
    result["gguf_native_vs_fp32"] = _r(ratio(tok.get("gguf_native"), tok["fp32"]))
    result["q4_vs_llamacpp"] = _r(ratio(q4, result["llamacpp_tok_s"]))
    result["gguf_native_vs_llamacpp"] = _r(ratio(tok.get("gguf_native"), result["llamacpp_tok_s"]))
    result["ggml_vs_llamacpp"] = _r(ratio(tok.get("ggml"), result["llamacpp_tok_s"]))
    result["ggml_identical_to_llamacpp"] = (llama["tokens"] == decode["ggml"]["tokens"]
                                            if llama_ok and "ggml" in decode else None)
    for key in keys:
        if key != "fp32":
            result[f"{key}_bytes_vs_fp32"] = _r(info[key]["block_bytes"] / fp32_bytes, 4)
    for key in keys:
        result[f"ppl_{key}"] = _r(ppl[key]["ppl"], 4)
    for key in keys:
        if key != "fp32":
            result[f"ppl_{key}_vs_fp32"] = _r(ppl[key]["ppl"] / ppl["fp32"]["ppl"], 4)
    for key in keys:
        result[f"agree_{key}"] = _r(quality[key]["agree"], 4)
    for key in keys:
        result[f"tf_agree_{key}"] = _r(quality[key]["tf_agree"], 4)
    for key in keys:
        result[f"kl_{key}"] = float(f"{quality[key]['kl']:.3g}")
    result["first_diff"] = {k: quality[k]["first_diff"] for k in keys if k != "fp32"}
    result["agree_positional"] = {k: _r(quality[k]["agree_positional"], 4) for k in keys if k != "fp32"}
    result["prefill_tok_s"] = {k: _r(prefill[k], 1) for k in keys} | {
        "llamacpp": _r(llama["prefill_tok_s"], 1) if llama_ok else None}
    result["step_ms_median"] = {k: _r(decode[k]["step_ms_median"], 2) for k in keys}
    result["tok_s_trials"] = {k: decode[k]["tok_s_trials"] for k in keys}
    result["contention"] = {"loadavg_1m_before": round(load_before, 2), "loadavg_1m_after": round(load_after, 2),
                            "cpu_share_min": {k: round(decode[k]["cpu_share_min"], 3) for k in keys}}
    result["block_bytes"] = {k: info[k]["block_bytes"] for k in keys}
    result["blocks_equal"] = all(info[k]["blocks_equal"] for k in keys)
    result["weight_bytes_per_block"] = {k: info[k]["weight_bytes_per_block"] for k in keys}
    result["model_ids"] = {k: info[k]["model_id"] for k in keys}
    result["q4_g32_4bit_is_gguf_native"] = same_grid
    result["tokens_stable"] = not unstable
    result["llamacpp"] = None if llama_build is None else {
        **{k: llama_build.get(k) for k in ("build", "build_s", "build_total_s", "built_in_this_run", "ensure_s",
                                          "version", "error") if llama_build.get(k) is not None},
        **({"prefill_chat_tok_s": _r(llama["prefill_chat_tok_s"], 1),
            "decode_trials_s": [round(s, 3) for s in llama["decode_trials_s"] or []],
            "system_info": llama["system_info"],
            "tokens_match_gguf_native": common_prefix(llama["tokens"], decode["gguf_native"]["tokens"])
            if "gguf_native" in decode else None,
            "tokens_match_ggml": common_prefix(llama["tokens"], decode["ggml"]["tokens"])
            if "ggml" in decode else None} if llama_ok else {}),
        **({"measure_error": llama["error"]} if llama is not None and not llama_ok else {}),
    }
    result["llamacpp_build_s"] = llama_build.get("build_s") if llama_build else None
    values = {"q4_vs_fp32": result["q4_vs_fp32"], "q4_vs_llamacpp": result["q4_vs_llamacpp"],
              "ggml_vs_llamacpp": result["ggml_vs_llamacpp"],
              "q4_bytes_vs_fp32": result.get("q4_bytes_vs_fp32"), "ppl_q4_vs_fp32": result.get("ppl_q4_vs_fp32"),
              "ppl_int8_vs_fp32": result.get("ppl_int8_vs_fp32")}
    result["targets_met"] = {
        name: (values[name] is not None and (values[name] >= bound if op == ">=" else values[name] <= bound))
        for name, (op, bound) in TARGETS.items()}
    result |= {"decode_tokens": args.tokens, "trials": args.trials, "prompt_tokens": len(chat_ids),
               "prefill_tokens": len(prefill_ids), "ppl_tokens": len(ppl_ids),
               "ppl_predicted": ppl["fp32"]["predicted"], "ppl_window": PPL_WINDOW, "quality_prompts": len(prompts),
               "machine": machine, "timestamp": datetime.datetime.now(datetime.UTC).isoformat(
                   timespec="seconds"), "commit": git_commit(), "wall_s": round(time.perf_counter() - began, 1)}
    log("targets: " + ", ".join(f"{name} {TARGETS[name][0]} {TARGETS[name][1]}: {values[name]} "
                                f"{'met' if ok else 'NOT met'}" for name, ok in result["targets_met"].items()))
    log(f"total {result['wall_s']} s")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="timed decode steps; greedy tokens per quality prompt")
    parser.add_argument("--trials", type=int, default=3, help="decode / prefill trials (median reported)")
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="tokens of the text for perplexity (>= 2048)")
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                        help=f"comma-separated, of {', '.join(FORMATS)} (default {','.join(DEFAULT_FORMATS)})")
    parser.add_argument("--skip-llamacpp", action="store_true", help="no llama.cpp build or measurement")
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "node_compute.jsonl"),
                        help="JSON-lines file the summary is appended to ('' for none)")
    args = parser.parse_args()
    if args.ppl_tokens < 2048:
        parser.error("--ppl-tokens must be >= 2048")
    if args.tokens < 2 or args.trials < 1:
        parser.error("--tokens >= 2 and --trials >= 1")
    torch.set_num_threads(1)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    cleanup = Cleanup()
    try:
        result = run(args, cleanup)
    finally:
        cleanup.run()
    return finish(result, args.results)


if __name__ == "__main__":
    sys.exit(main())
