"""Builds tests/data/tokenizers/qwen2.5/: Qwen2.5's tokenizer (151,665 tokens, a model
vocabulary of 151,936) and its chat template, for the tool-call tests' tiny model.

Neither is on PyPI. llama.cpp's sources (in llama-cpp-python's sdist, which
bench/llamacpp_ref.py caches) carry Qwen2's vocabulary as a vocabulary-only GGUF
(models/ggml-vocab-qwen2.gguf) and Qwen2.5-7B-Instruct's chat template
(models/templates/Qwen-Qwen2.5-7B-Instruct.jinja). Qwen2.5 is Qwen2's vocabulary with
its added tokens named: those (<tool_call> and </tool_call> among them, not special,
as Qwen2.5 has them) replace Qwen2's [PAD...] placeholders.

    python tools/qwen_tokenizer.py [SDIST]
"""

from __future__ import annotations

import json
import lzma
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "tokenizers" / "qwen2.5"
SDIST = REPO / ".cache" / "bench-llamacpp" / "sdist" / "llama_cpp_python-0.3.36.tar.gz"
MODELS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
ADDED = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
         "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
         "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
         "<|repo_name|>", "<|file_sep|>")
FIRST_ADDED = 151646  # after <|endoftext|> (the first added token), <|im_start|>, <|im_end|>
NOT_SPECIAL = 151657  # <tool_call> and after: plain added tokens (they show in decoded text)


def main(sdist: Path) -> None:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp, tarfile.open(sdist) as tar:
        for name in ("ggml-vocab-qwen2.gguf", "templates/Qwen-Qwen2.5-7B-Instruct.jinja"):
            member = tar.getmember(MODELS + name)
            member.name = Path(name).name
            tar.extract(member, tmp)
        AutoTokenizer.from_pretrained(tmp, gguf_file="ggml-vocab-qwen2.gguf").save_pretrained(f"{tmp}/hf")
        tokenizer = json.loads(Path(f"{tmp}/hf/tokenizer.json").read_text())
        template = Path(tmp, "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    kept = []
    for token in tokenizer["added_tokens"]:
        index = token["id"] - FIRST_ADDED
        if 0 <= index < len(ADDED):
            token.update(content=ADDED[index], special=token["id"] < NOT_SPECIAL)
        if index < len(ADDED):
            kept.append(token)
    tokenizer["added_tokens"] = kept
    # The BPE vocabulary ends before the added tokens (as Qwen2.5's own tokenizer.json does).
    vocab = tokenizer["model"]["vocab"]
    tokenizer["model"]["vocab"] = {piece: i for piece, i in vocab.items() if i < kept[0]["id"]}
    OUT.mkdir(parents=True, exist_ok=True)
    with lzma.open(OUT / "tokenizer.json.xz", "wt", preset=9) as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    (OUT / "chat_template.jinja").write_text(template)
    (OUT / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 131072}, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else SDIST)
