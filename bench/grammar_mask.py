"""The grammar's cost on the consumer: mask time per token, for llguidance (the one
CompuShare uses) beside xgrammar and outlines-core, at SmolLM2's 49,152-token and
Qwen2.5's 151,936-token vocabularies, and its share of a decode step.

Method: each library in a process of its own (the two others installed with pip
`--target` into .cache/bench-grammar, never into the project's venv) compiles one
JSON schema (nested objects, an array, an enum) and computes the mask before each
token of a valid 60-token document, then turns it into the logits' -inf entries as
pipeline/client/grammar.py does. The first mask (where lexers are built lazily) is
reported apart from the median and 90th percentile of the rest. A decode step:
SmolLM2's 30 blocks and LM head in one process (torch, fp32, at ~100 tokens of
context), and, for the 151k vocabulary, Qwen2.5-0.5B's LM head alone (896 x 151,936,
random weights): a lower bound of that model's step.

    python bench/grammar_mask.py [--results bench/results/grammar_mask.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, finish

CACHE = REPO / ".cache" / "bench-grammar"
OTHERS = ("xgrammar==0.2.9", "outlines-core==0.2.14", "apache-tvm-ffi==0.1.15.post2")
LIBRARIES = ("llguidance", "xgrammar", "outlines")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "mood": {"enum": ["happy", "sad", "calm"]},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
    "required": ["name", "age", "mood", "address", "tags"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "mood": "calm", "address": {"city": "London", "zip": "W1 1AA"},
            "tags": ["math", "engines", "poetry"]}
TIMEOUT_S = 600


def measure(library: str, tokenizer_dir: str, vocab: int) -> dict:
    """One library, one vocabulary (run in a child process: `--child`)."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    logits = torch.zeros(vocab)
    began = time.perf_counter()
    if library == "llguidance":
        import llguidance.hf

        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        prepared = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))

        def mask() -> np.ndarray:
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            return np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)

        take = matcher.consume_token
    elif library == "xgrammar":
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        prepared = time.perf_counter()
        compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)

        def mask() -> np.ndarray:
            matcher.fill_next_token_bitmask(bitmask)
            return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)

        take = matcher.accept_token
    else:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        vocabulary = Vocabulary(tokenizer.eos_token_id, _token_bytes(tokenizer, vocab))
        prepared = time.perf_counter()
        guide = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary))
        words = np.zeros((vocab + 31) // 32, dtype=np.int32)

        def mask() -> np.ndarray:
            guide.write_mask_into(words.ctypes.data, words.size, 4)
            return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)

        take = guide.advance
    compiled_at = time.perf_counter()
    times = []
    for token in tokens:
        start = time.perf_counter()
        allowed = mask()
        logits.masked_fill_(torch.from_numpy(~allowed), float("-inf"))
        times.append(time.perf_counter() - start)
        assert allowed[token], (library, token)
        take(token)
        logits.zero_()
    rest = sorted(times[1:])
    return {"library": library, "vocab": vocab, "tokenizer_s": round(prepared - began, 3),
            "compile_s": round(compiled_at - prepared, 4), "tokens": len(tokens),
            "first_mask_ms": round(times[0] * 1e3, 3), "mask_ms": round(statistics.median(rest) * 1e3, 4),
            "mask_p90_ms": round(rest[int(0.9 * len(rest))] * 1e3, 4)}


def _token_bytes(tokenizer, vocab: int) -> dict:
    """outlines-core's vocabulary: each token's bytes (byte-level BPE's characters mapped back)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    table: dict = {}
    for piece, index in tokenizer.get_vocab().items():
        if index == tokenizer.eos_token_id or index >= vocab:
            continue
        try:
            data = bytes(chars[c] for c in piece)
        except KeyError:
            data = piece.encode()
        table.setdefault(data, []).append(index)
    return table


def decode_step_ms(model_dir: Path) -> float:
    """SmolLM2's decode step in one process: 30 blocks and the LM head, ~100 tokens of context."""
    import torch

    from compushare.spans import load_head, load_span

    head = load_head(model_dir, runtime="torch")
    span = load_span(model_dir, 0, 30, runtime="torch")
    cache = span.new_cache()
    with torch.inference_mode():
        span.forward(head.embed_tokens(list(range(1, 100))), cache, 0)
        times = []
        for token in range(20):
            start = time.perf_counter()
            hidden = span.forward(head.embed_tokens([100 + token]), cache, span.cached_length(cache))
            head.logits(hidden)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def qwen_head_ms() -> float:
    """Qwen2.5-0.5B's LM head alone (896 x 151,936, fp32): a lower bound of its decode step."""
    import torch

    weight, hidden = torch.randn(151936, 896), torch.randn(1, 896)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        hidden @ weight.T
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _install_others(log: Path) -> None:
    if (CACHE / "lib" / ".done").exists():
        return
    (CACHE / "lib").mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(CACHE / "lib"),
                        *OTHERS], check=True, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    (CACHE / "lib" / ".done").touch()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "grammar_mask.jsonl"))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import QWEN_VOCAB, unpack_qwen_tokenizer

    from compushare.model.catalog import resolve_model

    smol = resolve_model("smollm2-135m", CACHE / "home")
    log = CACHE / "install.log"
    CACHE.mkdir(parents=True, exist_ok=True)
    _install_others(log)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        qwen = unpack_qwen_tokenizer(Path(tmp) / "qwen")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(CACHE / "lib")]))
        for tokenizer_dir, vocab in ((smol.path, 49152), (qwen, QWEN_VOCAB)):
            for library in LIBRARIES:
                out = subprocess.run([sys.executable, __file__, "--child", library, str(tokenizer_dir), str(vocab)],
                                     capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
                if out.returncode != 0:
                    raise SystemExit(f"{library} at {vocab}: {out.stderr[-2000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    step_ms, head_ms = decode_step_ms(smol.path), qwen_head_ms()
    ours = {row["vocab"]: row for row in rows if row["library"] == "llguidance"}
    result = {"bench": "grammar_mask", "libraries": rows, "smollm2_decode_step_ms": round(step_ms, 3),
              "qwen_0.5b_lm_head_ms": round(head_ms, 3),
              "mask_share_of_smollm2_step": round(ours[49152]["mask_ms"] / step_ms, 4),
              "mask_share_of_qwen_head": round(ours[QWEN_VOCAB]["mask_ms"] / head_ms, 4)}
    return finish(result, args.results)


if __name__ == "__main__":
    sys.exit(main())
