"""llama.cpp as a side-by-side reference: decode and prefill speed of a GGUF file.

    .venv/bin/python bench/llamacpp_ref.py GGUF_PATH [--tokens 64] [--trials 3]

Importable from the other bench scripts (`from llamacpp_ref import measure_llamacpp`
with bench/ on sys.path, or `import bench.llamacpp_ref`).

build     llama-cpp-python==0.3.36 built from its sdist, CPU only, into a scratch venv
          at <repo>/.cache/bench-llamacpp/venv (<$COMPUSHARE_CACHE>/bench-llamacpp/venv
          when COMPUSHARE_CACHE is set), once: `ensure_llamacpp()`. Variants, first one
          whose smoke test passes wins:
            native  -DGGML_NATIVE=ON (-march=native)
            avx512  -DGGML_NATIVE=OFF, AVX2/FMA/F16C + AVX512F and whichever of
                    AVX512-VBMI/VNNI/BF16 and AVX-VNNI /proc/cpuinfo lists; AMX off
            avx2    -DGGML_NATIVE=OFF, AVX2/FMA/F16C, no AVX512, AMX off
          (a native build is known to die with SIGILL on one of this fleet's CPU types).
          Always -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF and no tests/tools/examples/server;
          CMAKE_BUILD_PARALLEL_LEVEL=2. The smoke test runs in a subprocess: import
          llama_cpp, then a Q4_1 x F32 and an F32 x F32 ggml matmul checked against numpy
          (and, when a GGUF is given, loading it and decoding a few tokens). A build
          verified on another CPU (model name + flags) is smoke-tested again before use;
          a SIGILL during a measurement rebuilds with the next variant and retries once.
          build.json next to the venv records the variant, the compile time of the
          winning build (`build_s`, the pip install of the sdist), the failed attempts
          and the total; `build_info()` returns it. A file lock makes concurrent callers
          build once; a second call is instant.
measure   in a subprocess with the scratch venv's python: Llama(n_threads=T,
          n_threads_batch=T, n_ctx=512, flash_attn=True, seed=0) (T = `threads`, 1 by
          default; flash attention as llama.cpp's CPU default has it); per trial llm.reset(), the prompt in one
          llm.eval (prefill; its logits give the first token t_0), then `decode_tokens`
          single-token llm.eval steps, each followed by the argmax of the last logits
          (greedy, no stop at EOS). prefill tok/s = prompt tokens / prefill time; decode
          tok/s = decode_tokens / (t_N - t_0), i.e. decode only. One untimed warm-up, then
          the median over `trials`.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
VARIANTS = ("native", "avx512", "avx2")
DEFAULT_PROMPT = (
    "The history of computing is a story of machines that became smaller, faster and "
    "cheaper with every decade. In the beginning, a single computer filled a whole room"
)
_RESULT_MARK = "@@LLAMACPP_REF@@ "
_COMMON_CMAKE = [
    "-DGGML_OPENMP=OFF",
    "-DGGML_BLAS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_RPC=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAVA_BUILD=OFF",
]
_TIMEOUT_VENV_S = 600
_TIMEOUT_PIP_S = 1800
_TIMEOUT_BUILD_S = 3600
_TIMEOUT_SMOKE_S = 300


class LlamaCppError(RuntimeError):
    pass


class _Crash(LlamaCppError):
    """The subprocess died of a signal (SIGILL: the build uses instructions this CPU lacks)."""


# ---------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    env = os.environ.get("COMPUSHARE_CACHE")
    base = Path(env).expanduser() if env else REPO / ".cache"
    return base / "bench-llamacpp"


def _venv_dir() -> Path:
    return cache_dir() / "venv"


def _venv_python() -> Path:
    return _venv_dir() / "bin" / "python"


def _info_path() -> Path:
    return cache_dir() / "build.json"


def _log(msg: str) -> None:
    print(f"[llamacpp_ref] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- cpu


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_fingerprint() -> str:
    """Model name + family/model + the SIMD flags: what decides whether a build runs."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "stepping") and key not in fields:
                fields[key] = val.strip()
    except OSError:
        fields["machine"] = platform.machine()
    simd = sorted(f for f in _cpu_flags() if f.startswith(("avx", "amx", "sse", "fma", "f16c", "bmi")))
    raw = json.dumps([fields, simd], sort_keys=True)
    name = fields.get("model name", platform.machine())
    return f"{name} fam{fields.get('cpu family', '?')} model{fields.get('model', '?')} " + hashlib.sha256(raw.encode()).hexdigest()[:12]


def _cmake_args(variant: str) -> list[str]:
    flags = _cpu_flags()
    if variant == "native":
        return ["-DGGML_NATIVE=ON", *_COMMON_CMAKE]
    def on(name: str, flag: str | None = None, *, want: bool = True) -> str:
        ok = want and (flag is None or flag in flags)
        return f"-D{name}={'ON' if ok else 'OFF'}"
    avx512 = variant == "avx512" and "avx512f" in flags
    return [
        "-DGGML_NATIVE=OFF",
        on("GGML_SSE42", "sse4_2"),
        on("GGML_AVX", "avx"),
        on("GGML_AVX2", "avx2"),
        on("GGML_FMA", "fma"),
        on("GGML_F16C", "f16c"),
        on("GGML_BMI2", "bmi2"),
        on("GGML_AVX_VNNI", "avx_vnni"),
        on("GGML_AVX512", "avx512f", want=avx512),
        on("GGML_AVX512_VBMI", "avx512vbmi", want=avx512),
        on("GGML_AVX512_VNNI", "avx512_vnni", want=avx512),
        on("GGML_AVX512_BF16", "avx512_bf16", want=avx512),
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
        *_COMMON_CMAKE,
    ]


# ---------------------------------------------------------------------------- subprocess


def _run(cmd: list[str], *, timeout: float, env: dict | None = None, log: Path | None = None,
         input_text: str | None = None) -> subprocess.CompletedProcess:
    """Run cmd in its own process group; on timeout or any error, kill the whole group."""
    out = open(log, "a") if log is not None else subprocess.PIPE
    try:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT if log is not None else subprocess.PIPE,
            stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            text=True, start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(input_text, timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout or "", stderr or "")
    finally:
        if log is not None:
            out.close()


def _child_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _check(res: subprocess.CompletedProcess, what: str) -> str:
    if res.returncode < 0:
        sig = -res.returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        raise _Crash(f"{what}: killed by {name}\n{res.stderr[-2000:]}")
    if res.returncode != 0:
        raise LlamaCppError(f"{what}: exit {res.returncode}\n{(res.stderr or res.stdout)[-3000:]}")
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(_RESULT_MARK):
            return line[len(_RESULT_MARK):]
    raise LlamaCppError(f"{what}: no result line\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")


# ---------------------------------------------------------------------------- smoke test

_SMOKE = r'''
import ctypes, json, sys, pathlib
import numpy as np
import llama_cpp

llama_cpp.llama_backend_init()
info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
lib = pathlib.Path(llama_cpp.__file__).parent / "lib"
base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)

class Params(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

vp = ctypes.c_void_p
base.ggml_init.restype = vp; base.ggml_init.argtypes = [Params]
base.ggml_free.argtypes = [vp]
base.ggml_new_tensor_2d.restype = vp; base.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
base.ggml_mul_mat.restype = vp; base.ggml_mul_mat.argtypes = [vp, vp, vp]
base.ggml_new_graph.restype = vp; base.ggml_new_graph.argtypes = [vp]
base.ggml_build_forward_expand.argtypes = [vp, vp]
base.ggml_get_data.restype = vp; base.ggml_get_data.argtypes = [vp]
base.ggml_nbytes.restype = ctypes.c_size_t; base.ggml_nbytes.argtypes = [vp]
base.ggml_quantize_chunk.restype = ctypes.c_size_t
base.ggml_quantize_chunk.argtypes = [ctypes.c_int, vp, vp, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, vp]
cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
cpu.ggml_cpu_init()

F32, Q4_1 = 0, 3
K, M, N = 512, 96, 7
rng = np.random.default_rng(0)
W = rng.standard_normal((M, K)).astype(np.float32)
X = rng.standard_normal((N, K)).astype(np.float32)
ref = X @ W.T
errs = {}
for name, wtype in (("f32", F32), ("q4_1", Q4_1)):
    ctx = base.ggml_init(Params(64 << 20, None, False))
    w = base.ggml_new_tensor_2d(ctx, wtype, K, M)
    x = base.ggml_new_tensor_2d(ctx, F32, K, N)
    if wtype == F32:
        ctypes.memmove(base.ggml_get_data(w), W.ctypes.data, W.nbytes)
    else:
        n = base.ggml_quantize_chunk(wtype, W.ctypes.data, base.ggml_get_data(w), 0, M, K, None)
        assert n == base.ggml_nbytes(w), (n, base.ggml_nbytes(w))
    ctypes.memmove(base.ggml_get_data(x), X.ctypes.data, X.nbytes)
    y = base.ggml_mul_mat(ctx, w, x)
    gf = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(gf, y)
    for threads in (1, 2):
        assert cpu.ggml_graph_compute_with_ctx(ctx, gf, threads) == 0
        out = np.ctypeslib.as_array(ctypes.cast(base.ggml_get_data(y), ctypes.POINTER(ctypes.c_float)), shape=(N, M)).copy()
        errs[f"{name}_t{threads}"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    base.ggml_free(ctx)
assert errs["f32_t1"] < 1e-4 and errs["f32_t2"] < 1e-4, errs
assert errs["q4_1_t1"] < 0.2 and errs["q4_1_t2"] < 0.2, errs

gguf = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None
toks = None
if gguf:
    llm = llama_cpp.Llama(model_path=gguf, n_threads=1, n_threads_batch=1, n_ctx=128, verbose=False, seed=0)
    llm.eval(llm.tokenize(b"Hello, my name is", add_bos=True, special=False))
    n_vocab = llm.n_vocab()
    toks = []
    for _ in range(4):
        t = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))
        toks.append(t)
        llm.eval([t])
    llm.close()
print("@@LLAMACPP_REF@@ " + json.dumps({"ok": True, "errs": errs, "system_info": info, "tokens": toks,
                                         "version": llama_cpp.__version__}), flush=True)
'''


def _smoke(python: Path, gguf: str | os.PathLike | None = None) -> dict:
    res = _run([str(python), "-c", _SMOKE, str(gguf or "")], timeout=_TIMEOUT_SMOKE_S, env=_child_env())
    return json.loads(_check(res, "smoke test"))


# ---------------------------------------------------------------------------- build


@contextlib.contextmanager
def _lock(shared: bool = False):
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_info() -> dict | None:
    """build.json: variant, build_s (compile of the winning build), attempts, total_s, ..."""
    try:
        return json.loads(_info_path().read_text())
    except (OSError, ValueError):
        return None


def _write_info(info: dict) -> None:
    p = _info_path()
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, p)


def _ensure_venv(log: Path) -> Path:
    py = _venv_python()
    if py.exists() and _run([str(py), "-c", "import numpy, jinja2, diskcache, typing_extensions"],
                            timeout=120, env=_child_env()).returncode == 0:
        return py
    if _venv_dir().exists():
        shutil.rmtree(_venv_dir())
    _check_rc(_run([sys.executable, "-m", "venv", str(_venv_dir())], timeout=_TIMEOUT_VENV_S, log=log), "venv")
    # llama-cpp-python's runtime dependencies (binary wheels are fine for these).
    _check_rc(_run([str(py), "-m", "pip", "install", "-q", "numpy>=1.20", "typing-extensions>=4.5",
                    "diskcache>=5.6.1", "jinja2>=2.11.3"], timeout=_TIMEOUT_PIP_S, env=_child_env(), log=log),
              "pip install dependencies")
    return py


def _check_rc(res: subprocess.CompletedProcess, what: str) -> None:
    if res.returncode != 0:
        raise LlamaCppError(f"{what} failed (exit {res.returncode}); see {cache_dir() / 'build.log'}")


def _sdist(py: Path, log: Path) -> Path:
    d = cache_dir() / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if (d / name).exists():
        return d / name
    d.mkdir(parents=True, exist_ok=True)
    _check_rc(_run([str(py), "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(d)],
                   timeout=_TIMEOUT_PIP_S, env=_child_env(), log=log), "pip download sdist")
    hits = sorted(d.glob("llama_cpp_python-*.tar.gz"))
    if not hits:
        raise LlamaCppError(f"no sdist in {d}")
    return hits[-1]


def _build(variant: str, py: Path, sdist: Path, log: Path) -> float:
    env = _child_env()
    env["CMAKE_ARGS"] = " ".join(_cmake_args(variant))
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = "2"
    env["FORCE_CMAKE"] = "1"
    env.pop("SOURCE_DATE_EPOCH", None)  # would turn GGML_NATIVE's default and the ISA defaults off
    with open(log, "a") as fh:
        fh.write(f"\n===== build {variant}: CMAKE_ARGS={env['CMAKE_ARGS']}\n")
    t0 = time.monotonic()
    # --no-cache-dir: pip's wheel cache would hand back a build made with other CMAKE_ARGS.
    res = _run([str(py), "-m", "pip", "install", "-v", "--no-cache-dir", "--force-reinstall", "--no-deps",
                "--no-binary", "llama-cpp-python", str(sdist)], timeout=_TIMEOUT_BUILD_S, env=env, log=log)
    dt = time.monotonic() - t0
    _check_rc(res, f"build {variant}")
    return dt


def _build_chain(start: str, gguf, reason: str) -> dict:
    """Build variants from `start` on until one passes the smoke test. Caller holds the lock."""
    d = cache_dir()
    log = d / "build.log"
    with contextlib.suppress(FileNotFoundError):
        _info_path().unlink()  # no valid build until one passes
    t_total = time.monotonic()
    py = _ensure_venv(log)
    sdist = _sdist(py, log)
    attempts = []
    for variant in VARIANTS[VARIANTS.index(start):]:
        if variant == "avx512" and "avx512f" not in _cpu_flags():
            continue
        _log(f"building llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} from sdist, variant {variant} "
             f"(2 jobs; log {log})")
        try:
            build_s = _build(variant, py, sdist, log)
        except LlamaCppError as e:
            attempts.append({"variant": variant, "ok": False, "error": str(e)[:500]})
            _log(f"variant {variant}: build failed: {e}")
            continue
        try:
            smoke = _smoke(py, gguf)
        except LlamaCppError as e:  # includes _Crash (SIGILL)
            attempts.append({"variant": variant, "ok": False, "build_s": round(build_s, 1), "error": str(e)[:500]})
            _log(f"variant {variant}: built in {build_s:.0f} s but the smoke test failed: {str(e).splitlines()[0]}")
            continue
        attempts.append({"variant": variant, "ok": True, "build_s": round(build_s, 1)})
        info = {
            "variant": variant,
            "build_s": round(build_s, 1),
            "total_s": round(time.monotonic() - t_total, 1),
            "version": smoke["version"],
            "cmake_args": _cmake_args(variant),
            "system_info": smoke["system_info"],
            "built_on": cpu_fingerprint(),
            "verified_on": [cpu_fingerprint()],
            "attempts": attempts,
            "reason": reason,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _write_info(info)
        _log(f"variant {variant} works: compile {build_s:.0f} s, total {info['total_s']:.0f} s")
        return info
    raise LlamaCppError(f"no llama-cpp-python build works here: {json.dumps(attempts)[:2000]}")


def ensure_llamacpp(*, gguf: str | os.PathLike | None = None) -> Path:
    """Build (once) and return the scratch venv's python, with a working llama_cpp.

    `gguf`: optionally also load this model and decode a few tokens in the smoke test
    (only when a smoke test runs: first build, or a CPU this build was not verified on).
    """
    with _lock():
        info = build_info()
        py = _venv_python()
        fp = cpu_fingerprint()
        if info and py.exists() and info.get("version") == LLAMA_CPP_PYTHON_VERSION:
            if fp in info.get("verified_on", []):
                return py
            _log(f"build '{info['variant']}' not yet verified on this CPU ({fp}): smoke test")
            try:
                _smoke(py, gguf)
                info["verified_on"].append(fp)
                _write_info(info)
                return py
            except LlamaCppError as e:
                _log(f"smoke test failed: {str(e).splitlines()[0]}")
                nxt = VARIANTS.index(info["variant"]) + 1
                if nxt >= len(VARIANTS):
                    raise
                _build_chain(VARIANTS[nxt], gguf, f"{info['variant']} failed on {fp}")
                return py
        _build_chain(VARIANTS[0], gguf, "first build")
        return py


def _rebuild_after_crash(crashed_variant: str, gguf) -> None:
    with _lock():
        info = build_info()
        if info and info.get("variant") != crashed_variant:
            return  # another process already rebuilt
        nxt = VARIANTS.index(crashed_variant) + 1
        if nxt >= len(VARIANTS):
            raise LlamaCppError(f"variant {crashed_variant} crashed and there is no fallback left")
        _build_chain(VARIANTS[nxt], gguf, f"{crashed_variant} crashed during a measurement on {cpu_fingerprint()}")


# ---------------------------------------------------------------------------- measure

_MEASURE = r'''
import json, statistics, sys, time
import numpy as np
import llama_cpp

a = json.loads(sys.stdin.read())
llm = llama_cpp.Llama(model_path=a["gguf"], n_threads=a["threads"], n_threads_batch=a["threads"],
                      n_ctx=a["n_ctx"], flash_attn=a["flash_attn"], verbose=False, seed=0)
if a["prompt_tokens"] is not None:
    prompt = [int(t) for t in a["prompt_tokens"]]
else:
    prompt = llm.tokenize(a["prompt_text"].encode("utf-8"), add_bos=True, special=True)
n_dec = int(a["decode_tokens"])
if not prompt:
    raise SystemExit("empty prompt")
if len(prompt) + n_dec + 1 > a["n_ctx"]:
    raise SystemExit(f"prompt {len(prompt)} + {n_dec} decode tokens do not fit n_ctx={a['n_ctx']}")
n_vocab = llm.n_vocab()
ctx = llm.ctx
get = llama_cpp.llama_get_logits_ith

def argmax_last():
    return int(np.argmax(np.ctypeslib.as_array(get(ctx, -1), shape=(n_vocab,))))

def trial(n):
    llm.reset()
    t_a = time.perf_counter()
    llm.eval(prompt)
    tok = argmax_last()
    t_0 = time.perf_counter()
    out = [tok]
    for _ in range(n):
        llm.eval([tok])
        tok = argmax_last()
        out.append(tok)
    t_n = time.perf_counter()
    return t_0 - t_a, t_n - t_0, out

trial(min(4, n_dec))  # warm-up: page in the weights, first-call allocations
pre, dec, toks = [], [], None
for _ in range(int(a["trials"])):
    p, d, toks = trial(n_dec)
    pre.append(p)
    dec.append(d)
res = {
    "decode_tok_s": n_dec / statistics.median(dec) if n_dec else None,
    "prefill_tok_s": len(prompt) / statistics.median(pre),
    "tokens": toks,
    "prompt_tokens": len(prompt),
    "decode_steps": n_dec,
    "trials_decode_s": dec,
    "trials_prefill_s": pre,
    "version": llama_cpp.__version__,
    "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
}
llm.close()
print("@@LLAMACPP_REF@@ " + json.dumps(res), flush=True)
'''


def measure_llamacpp(
    gguf_path: str | os.PathLike,
    *,
    prompt_tokens: list[int] | None = None,
    prompt_text: str | None = None,
    decode_tokens: int = 64,
    trials: int = 3,
    n_ctx: int = 512,
    timeout: float = 900.0,
    threads: int = 1,
    flash_attn: bool = True,
) -> dict:
    """llama.cpp at `threads` threads on `gguf_path`: decode and prefill tok/s (medians over trials).

    Flash attention is on by default, as llama.cpp's own default turns it on for CPU
    ("auto"; llama-cpp-python's Llama would turn it off): the attention path the ggml
    runtime follows, so the tokens compare.

    The prompt is `prompt_tokens` if given, else `prompt_text` (default DEFAULT_PROMPT)
    tokenized by llama.cpp with the GGUF's own special-token rules. `tokens` holds the
    decode_tokens + 1 greedy ids of the last trial (the first from the prefill's logits).
    """
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(gguf_path)
    if prompt_tokens is None and prompt_text is None:
        prompt_text = DEFAULT_PROMPT
    payload = json.dumps({
        "gguf": str(gguf_path),
        "prompt_tokens": list(prompt_tokens) if prompt_tokens is not None else None,
        "prompt_text": prompt_text,
        "decode_tokens": int(decode_tokens),
        "trials": max(1, int(trials)),
        "n_ctx": int(n_ctx),
        "threads": int(threads),
        "flash_attn": bool(flash_attn),
    })
    for attempt in (0, 1):
        py = ensure_llamacpp(gguf=gguf_path)
        info = build_info() or {}
        try:
            with _lock(shared=True):  # no rebuild underneath a running measurement
                res = _run([str(py), "-c", _MEASURE], timeout=timeout, env=_child_env(), input_text=payload)
            out = json.loads(_check(res, "llama.cpp measurement"))
        except _Crash:
            if attempt or not info.get("variant"):
                raise
            _log(f"build '{info['variant']}' crashed during the measurement: rebuilding with the next variant")
            _rebuild_after_crash(info["variant"], gguf_path)
            continue
        out.update({
            "build": info.get("variant"),
            "build_s": info.get("build_s"),
            "build_total_s": info.get("total_s"),
            "threads": int(threads),
            "flash_attn": bool(flash_attn),
            "cpu": cpu_fingerprint(),
            "gguf": str(gguf_path),
        })
        return out
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", help="path to a .gguf file")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed (default 64)")
    ap.add_argument("--trials", type=int, default=3, help="trials, the median is reported (default 3)")
    ap.add_argument("--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT[:40]}...)")
    ap.add_argument("--timeout", type=float, default=900.0, help="measurement subprocess timeout, s")
    args = ap.parse_args(argv)
    res = measure_llamacpp(args.gguf, prompt_text=args.prompt, decode_tokens=args.tokens, trials=args.trials,
                           timeout=args.timeout)
    print(f"llama.cpp {res['version']} ({res['build']} build, compiled in {res['build_s']} s): "
          f"decode {res['decode_tok_s']:.1f} tok/s, prefill {res['prefill_tok_s']:.1f} tok/s "
          f"({res['prompt_tokens']} prompt tokens), 1 thread", file=sys.stderr)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
