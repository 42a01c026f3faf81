"""Greedy tokens of llama.cpp itself on the GGUF fixtures and SmolLM2's GGUF: the
reference tests/integration/test_ggml_llamacpp.py holds the ggml runtime to.

    .venv/bin/python tools/llamacpp_tokens.py      # rewrites tests/data/gguf/llamacpp_tokens.json

llama.cpp comes from bench/llamacpp_ref.py's build (llama-cpp-python 0.3.36 from its
sdist, built once per machine: minutes). Each file runs with llama.cpp's defaults on
CPU, flash attention included (llama.cpp's "auto" turns it on for CPU; llama-cpp-python
would turn it off), one thread, the prompt in one batch, then one token a step,
argmax of the last logits: TOKENS of them. The file records the build and the CPU
it ran on: a near-tie between two tokens could fall the other way on another CPU's
kernels, and then this is where to look.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data" / "gguf"
OUT = DATA / "llamacpp_tokens.json"
TOKENS = 64
PROMPT = [1, 17, 42, 99, 3, 200, 7]
# SmolLM2's GGUF: this text, as its tokenizer encodes it (bench/llamacpp_ref.py's prompt).
SMOLLM2_TEXT = ("The history of computing is a story of machines that became smaller, faster and cheaper with "
                "every decade. In the beginning")

GREEDY = r"""
import json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama
path, prompt, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(path, n_threads=1, n_threads_batch=1, n_ctx=512, seed=0, flash_attn=True, verbose=False)
vocab = llm.n_vocab()
def last():
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
llm.eval(prompt)
tokens = []
for _ in range(count):
    tokens.append(int(np.argmax(last())))
    llm.eval(tokens[-1:])
print(json.dumps(tokens))
"""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main() -> int:
    sys.path.insert(0, str(REPO / "bench"))
    sys.path.insert(0, str(REPO / "src"))
    import llamacpp_ref

    from compushare.config import resolve_cache_dir
    from compushare.model import sources
    from compushare.model.catalog import resolve_model

    python = llamacpp_ref.ensure_llamacpp()
    from tokenizers import Tokenizer

    files = {path.name: (path, PROMPT) for path in sorted(DATA.glob("*.gguf"))}
    smollm2 = Path(sources.smollm2_gguf(resolve_cache_dir()))
    store = resolve_model("smollm2-135m@gguf", Path(tempfile.mkdtemp(prefix="llamacpp-tokens-")))
    files[smollm2.name] = (smollm2, Tokenizer.from_file(str(store.path / "tokenizer.json")).encode(SMOLLM2_TEXT).ids)
    result = {"llama_cpp_python": llamacpp_ref.LLAMA_CPP_PYTHON_VERSION, "build": llamacpp_ref.build_info(),
              "cpu": llamacpp_ref.cpu_fingerprint(), "machine": platform.machine(), "tokens": TOKENS,
              "files": {}}
    for name, (path, prompt) in files.items():
        out = subprocess.run([str(python), "-c", GREEDY, str(path), json.dumps(prompt), str(TOKENS)],
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        result["files"][name] = {"sha256": sha256(path), "prompt": prompt,
                                 "tokens": json.loads(out.stdout.splitlines()[-1])}
        print(name, result["files"][name]["tokens"][:8], "...", flush=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
