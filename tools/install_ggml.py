"""Install ggml-python (pinned) on llama.cpp's own ggml, built for this machine's CPU, once per machine.

    python tools/install_ggml.py        # with the venv's python: `make` runs it

ggml-python 0.0.45's sdist vendors ggml 0.15.3; llama.cpp (llama-cpp-python 0.3.36,
bench/llamacpp_ref.py's reference) runs ggml 0.25.3, whose kernels round some
products differently (an 8B-shaped Q4_K_M file gave other logits from its 4th layer
on). So the wheel is ggml-python's bindings built over the ggml that llama-cpp-python
0.3.36's sdist vendors (its vendor/llama.cpp/ggml replaces ggml-python's vendor/ggml:
the tensor struct and every function ggml-python declares are the same): the ggml
runtime then computes with llama.cpp's very kernels. Built with GGML_NATIVE the
kernels use every SIMD extension the CPU has (AVX-512, VNNI, ...). A native wheel must never reach another CPU, so the wheel is built into the
machine's cache (<$COMPUSHARE_CACHE or ~/.cache/compushare>/wheels/ggml-<cpu>/)
under a key of the CPU's model and SIMD flags, and installed from there: a second
clone on this machine installs in seconds. The build is smoke-tested in a
subprocess (a quantized product checked against numpy); a build that dies (a
native build has died with SIGILL on one CPU type seen here) is replaced by the next
variant: native, then AVX-512 without AMX, then AVX2. OpenMP is off: torch brings
its own OpenMP runtime, and ggml's own thread pool serves it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.0.45"
BUILD = "2"  # cmake_args' revision, in the cached wheel's key (2: llamafile's sgemm on)
LLAMA_CPP_PYTHON = "0.3.36"  # whose vendored ggml the wheel is built over...
GGML = "0.25.3"  # ...this one
BUILD_TOOLS = ("scikit-build-core==1.1.2", "cmake==4.4.5", "ninja==1.13.2")
VARIANTS = ("native", "avx512", "avx2")


def cache_dir() -> Path:
    env = os.environ.get("COMPUSHARE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "compushare"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_key() -> str:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    text = "|".join([VERSION, LLAMA_CPP_PYTHON, BUILD, platform.machine(), model, *sorted(cpu_flags())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cmake_args(variant: str) -> str:
    # GGML_LLAMAFILE: llama.cpp's own build turns on llamafile's sgemm (its CMake sets the
    # default; ggml built alone leaves it off), which computes multi-row products of
    # Q8_0 / Q4_0 / F16 / F32 weights: without it a prompt through a Q8_0 matrix rounds
    # otherwise than llama.cpp (measured: gpt-oss's Q8_0 attention, logits 0.04 apart).
    common = ["-DGGML_OPENMP=OFF", "-DGGML_CCACHE=OFF", "-DGGML_LLAMAFILE=ON"]
    if variant == "native":
        return " ".join(["-DGGML_NATIVE=ON", *common])
    flags = cpu_flags()

    def on(name: str, flag: str, want: bool = True) -> str:
        return f"-D{name}={'ON' if want and flag in flags else 'OFF'}"

    avx512 = variant == "avx512"
    return " ".join(["-DGGML_NATIVE=OFF", *common, on("GGML_AVX", "avx"), on("GGML_AVX2", "avx2"),
                     on("GGML_FMA", "fma"), on("GGML_F16C", "f16c"), on("GGML_AVX_VNNI", "avx_vnni"),
                     on("GGML_AVX512", "avx512f", avx512), on("GGML_AVX512_VBMI", "avx512vbmi", avx512),
                     on("GGML_AVX512_VNNI", "avx512_vnni", avx512), on("GGML_AVX512_BF16", "avx512_bf16", avx512),
                     "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


def smoke_test(python: str) -> bool:
    """A Q8_0 product by ggml, checked against numpy, in a subprocess (a SIGILL kills
    only it)."""
    code = r"""
import ctypes, numpy as np, ggml
g = ggml
rng = np.random.default_rng(0)
w = rng.standard_normal((64, 256)).astype(np.float32); x = rng.standard_normal(256).astype(np.float32)
ctx = g.ggml_init(g.ggml_init_params(mem_size=16 << 20, mem_buffer=None))
a = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, 256, 64); b = g.ggml_new_tensor_1d(ctx, g.GGML_TYPE_F32, 256)
ctypes.memmove(g.ggml_get_data(a), w.ctypes.data, w.nbytes); ctypes.memmove(g.ggml_get_data(b), x.ctypes.data, x.nbytes)
out = g.ggml_mul_mat(ctx, a, b); graph = g.ggml_new_graph(ctx); g.ggml_build_forward_expand(graph, out)
g.ggml_graph_compute_with_ctx(ctx, graph, 1)
got = np.ctypeslib.as_array(ctypes.cast(g.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)), shape=(64,))
assert np.allclose(got, w @ x, rtol=1e-4, atol=1e-3), (got[:4], (w @ x)[:4])
assert g.ggml_version().decode() == "GGML_VERSION", g.ggml_version()
print("ok")
""".replace("GGML_VERSION", GGML)
    try:
        result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0 and result.stdout.strip().endswith("ok")


def installed(python: str, home: Path) -> bool:
    """This cache entry's wheel is what the interpreter has (a plain ggml-python of the
    same version, built over its own ggml, is not)."""
    marker = home / "verified"
    probe = subprocess.run([python, "-c", "import ggml; print(ggml.ggml_version().decode())"], capture_output=True,
                           text=True)
    return probe.returncode == 0 and probe.stdout.strip() == GGML and marker.exists()


def pip(python: str, *args: str, env: dict | None = None) -> None:
    subprocess.run([python, "-m", "pip", "-q", *args], check=True, env=env)


def sources(python: str, staging: Path) -> Path:
    """ggml-python's sdist, its vendored ggml replaced by llama-cpp-python's."""
    for spec in (f"ggml-python=={VERSION}", f"llama-cpp-python=={LLAMA_CPP_PYTHON}"):
        pip(python, "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation", "-d", str(staging),
            spec)
    for archive in staging.glob("*.tar.gz"):
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
    bindings = staging / f"ggml_python-{VERSION}"
    shutil.rmtree(bindings / "vendor" / "ggml")
    shutil.copytree(staging / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp" / "ggml",
                    bindings / "vendor" / "ggml")
    return bindings


def build(python: str, variant: str, home: Path) -> Path:
    pip(python, "install", *BUILD_TOOLS)
    staging = Path(tempfile.mkdtemp(prefix="ggml-wheel-"))
    try:
        bindings = sources(python, staging)
        env = dict(os.environ, CMAKE_ARGS=cmake_args(variant),
                   CMAKE_BUILD_PARALLEL_LEVEL=str(max(1, os.cpu_count() or 1)))
        print(f"[install_ggml] building ggml-python {VERSION} over llama-cpp-python {LLAMA_CPP_PYTHON}'s ggml "
              f"({variant}) for this CPU", flush=True)
        pip(python, "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-w", str(staging / "dist"),
            str(bindings), env=env)
        (wheel,) = (staging / "dist").glob("ggml_python-*.whl")
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        return Path(shutil.move(str(wheel), home / wheel.name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main() -> int:
    python = sys.executable
    home = cache_dir() / "wheels" / f"ggml-{cpu_key()}"
    verified = sorted(home.glob("ggml_python-*.whl")) if (home / "verified").exists() else []
    if verified:  # built and smoke-tested on this CPU before
        if not installed(python, home):
            pip(python, "install", "--no-deps", "--force-reinstall", str(verified[-1]))
        return 0
    for variant in VARIANTS:
        wheel = build(python, variant, home)
        pip(python, "install", "--no-deps", "--force-reinstall", str(wheel))
        if smoke_test(python):
            (home / "verified").write_text(variant)
            return 0
        print(f"[install_ggml] the {variant} build failed its smoke test on this CPU", flush=True)
        shutil.rmtree(home, ignore_errors=True)
    print("[install_ggml] no build of ggml runs on this CPU: GGUF spans will run on torch", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
