"""Write tests/data/gguf/: one small GGUF file per model family, made by llama.cpp's own
converter (convert_hf_to_gguf.py) from the tiny random checkpoint of that family
(tests/tiny_families.py), as the files people download are made.

Each checkpoint gets a SentencePiece tokenizer (tokenizer.model, trained here on a
fixed corpus), the one vocabulary path every family's converter class accepts (a
BPE tokenizer.json is refused by the converter unless its pre-tokenizer hash is one
it knows). Every family is written in f32, whose tensors hold the checkpoint's values
exactly; Qwen2 also in q8_0, the converter's own quantization.

    .venv/bin/python tools/family_ggufs.py [--llama-cpp DIR] [--out tests/data/gguf]

DIR: a llama.cpp source tree (convert_hf_to_gguf.py, conversion/, gguf-py/); by
default the llama-cpp-python sdist that bench/llamacpp_ref.py builds is unpacked
into a scratch directory. Needs sentencepiece (`pip install .[fixtures]`).
Deterministic: the same converter writes the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SDIST = "llama_cpp_python-0.3.36"
# Where bench/llamacpp_ref.py keeps the sdist it builds: $COMPUSHARE_CACHE, else <repo>/.cache.
SDIST_PATH = Path(os.environ.get("COMPUSHARE_CACHE") or ROOT / ".cache") / "bench-llamacpp" / "sdist" / f"{SDIST}.tar.gz"
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # the sdist's vendor/llama.cpp
SEED = 0
SMALL = dict(num_hidden_layers=2)  # tiny_families' configs, 2 layers
# family -> (the converter's outtypes written for it, tiny_config overrides). Gemma 3 gets
# its own layer pattern (5 sliding, 1 global), which is what llama.cpp assumes: its converter
# writes no layer types. Gemma 2's query scale is the head size: a GGUF file carries none,
# llama.cpp taking hidden / heads for 46 layers (27B) and the head size otherwise.
FIXTURES = {"llama": (("f32",), SMALL), "qwen2": (("f32", "q8_0"), SMALL), "qwen3": (("f32",), SMALL),
            "mistral": (("f32",), SMALL), "gemma2": (("f32",), SMALL | dict(query_pre_attn_scalar=16)),
            "gemma3": (("f32",), SMALL | dict(num_hidden_layers=6, layer_types=None)), "phi3": (("f32",), SMALL),
            # Mixtures of experts (4 layers: 3 nodes' spans). Mixtral is written as a "llama" file
            # with expert tensors; gpt-oss keeps its alternating sliding / full layers.
            "qwen3_moe": (("f32",), {}), "mixtral": (("f32",), {}), "gpt_oss": (("f32",), {})}
WORDS = ("the quick brown fox jumps over lazy dog pool model share compute node swarm token layer weight "
         "block peer file").split()
SPM_VOCAB = 120  # pieces of the SentencePiece model; the converter pads the vocabulary to the config's 256
# The Qwen3-MoE and gpt-oss converters read only a byte-level BPE tokenizer.json, and refuse
# one whose pre-tokenizer they do not recognise by hashing a fixed text's tokens: a tiny BPE
# trained here is no known one, so it is written as the family's own ("qwen2", "gpt-4o"), the
# one difference from a plain run of the converter (the vocabulary is ours; tests feed ids).
BPE_FAMILIES = {"qwen3_moe": "qwen2", "gpt_oss": "gpt-4o"}
# Tokens a family's checkpoint adds beyond the SentencePiece model (added_tokens.json), as
# its real checkpoints do: llama.cpp's vocabulary loader looks "<|endoftext|>" up in any
# model named Phi-3 (Phi-3's own has it at 32000) and refuses the file without it.
ADDED_TOKENS = {"phi3": {"<|endoftext|>": SPM_VOCAB}}


def fixture_name(family: str, outtype: str) -> str:
    return f"tiny-{family}-{outtype}.gguf"


def unpack_converter(scratch: Path) -> Path:
    """The sdist's vendored llama.cpp converter, unpacked under `scratch`."""
    prefix = f"{SDIST}/vendor/llama.cpp/"
    with tarfile.open(SDIST_PATH) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(CONVERTER_FILES)]
        archive.extractall(scratch, members=members, filter="data")
    return scratch / prefix


def add_sentencepiece_tokenizer(path: Path) -> None:
    """tokenizer.model (BPE, <pad> <s> </s> <unk> at 0..3, as the tiny configs say) beside
    the checkpoint in `path`, trained on a fixed corpus with one thread: deterministic."""
    import sentencepiece

    rng = random.Random(SEED)
    corpus = path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(path / "tokenizer"), vocab_size=SPM_VOCAB, model_type="bpe",
        num_threads=1, pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2)
    corpus.unlink()
    (path / "tokenizer.vocab").unlink()


def add_bpe_tokenizer(path: Path) -> None:
    """tokenizer.json (byte-level BPE, <pad> <s> </s> <unk> at 0..3; only the corpus's own
    characters, so that it fits the tiny configs' 256 ids) beside the checkpoint in `path`,
    trained on the same fixed corpus: deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(SEED)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=SPM_VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>")))


# Runs the converter with its pre-tokenizer check answered (BPE_FAMILIES), nothing else changed.
_CONVERT_AS = """
import runpy, sys
converter, pre_tokenizer = sys.argv[1], sys.argv[2]
sys.path.insert(0, converter)
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_tokenizer
script = converter + "/convert_hf_to_gguf.py"
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def convert(converter: Path, checkpoint: Path, out: Path, outtype: str, pre_tokenizer: str | None = None) -> None:
    env = dict(os.environ, PYTHONPATH=str(converter / "gguf-py"))
    arguments = [str(checkpoint), "--outtype", outtype, "--outfile", str(out)]
    command = [sys.executable, str(converter / "convert_hf_to_gguf.py"), *arguments]
    if pre_tokenizer is not None:
        command = [sys.executable, "-c", _CONVERT_AS, str(converter), pre_tokenizer, *arguments]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the converter failed on {checkpoint.name} ({outtype}):\n{done.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, help="a llama.cpp source tree (default: the sdist's)")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "gguf")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_families import make_tiny_family

    args.out.mkdir(parents=True, exist_ok=True)
    index = {}
    with tempfile.TemporaryDirectory(prefix="family-ggufs-") as scratch:
        converter = args.llama_cpp or unpack_converter(Path(scratch))
        for family, (outtypes, overrides) in FIXTURES.items():
            checkpoint = make_tiny_family(family, Path(scratch) / family, seed=SEED, **overrides)
            if family in BPE_FAMILIES:
                add_bpe_tokenizer(checkpoint)
            else:
                add_sentencepiece_tokenizer(checkpoint)
            if family in ADDED_TOKENS:
                (checkpoint / "added_tokens.json").write_text(json.dumps(ADDED_TOKENS[family]))
            for outtype in outtypes:
                target = args.out / fixture_name(family, outtype)
                convert(converter, checkpoint, target, outtype, BPE_FAMILIES.get(family))
                digest = hashlib.sha256(target.read_bytes()).hexdigest()
                index[target.name] = dict(family=family, seed=SEED, overrides=overrides, outtype=outtype,
                                          sha256=digest)
                print(f"{target.name}  {target.stat().st_size:>8} B  sha256 {digest[:16]}")
            shutil.rmtree(checkpoint)
    # What the tests rebuild each file's checkpoint from (tests/unit/test_gguf_families.py).
    (args.out / "fixtures.json").write_text(json.dumps(
        dict(converter=f"llama.cpp {LLAMA_CPP_COMMIT} (vendored in {SDIST})", files=index), indent=1) + "\n")


if __name__ == "__main__":
    main()
