"""Fine-tuning data: what `compushare finetune --data FILE` reads.

Two formats: a ".jsonl" file is JSONL, a ".txt" file text, any other told apart
by its first non-blank character ("{": JSONL).

- **JSONL**: one object per line (lines end at "\n" only) with string fields
  `prompt` and `response` (other keys are ignored; blank lines skipped).
  Each line is one example: the prompt as a user turn through the tokenizer's chat
  template with the generation prompt (the prompt's text and a newline where the
  tokenizer has no template), then the response's tokens and the end-of-sequence
  token. Only the response and that token count in the loss. An example longer
  than the sequence length is cut at its end; one whose response is cut away
  entirely is dropped (counted in `DataStats.dropped`).
- **Text** (anything else): tokenized whole (no special tokens; the end-of-sequence
  token appended where the tokenizer has one), cut into consecutive sequences of
  the sequence length (a last shorter one kept if it has at least 2 tokens); every
  position counts.

An Example holds token ids and, per position, whether the *next* token is a
target: `batches` turns examples into [B, T] input ids and labels (the next token,
or -100 where nothing counts), right-padded. Errors are UsageError naming the file
and line.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch

from ..errors import UsageError

IGNORE = -100  # a label that counts in no loss
EVAL_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class Example:
    ids: tuple[int, ...]
    counted: tuple[bool, ...]  # counted[i]: ids[i] is a target (predicted from ids[:i])

    @property
    def targets(self) -> int:
        return sum(self.counted[1:])


@dataclasses.dataclass
class DataStats:
    examples: int = 0
    dropped: int = 0  # JSONL examples whose response the sequence length cut away
    truncated: int = 0


def _read(path: Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such data file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise UsageError(f"{path}, line {line}: not UTF-8 text") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark, as some editors write
    if not text.strip():
        raise UsageError(f"{path}: the data file is empty")
    return text


def _eos(tokenizer) -> int | None:
    return getattr(tokenizer, "eos_token_id", None)


def text_examples(text: str, tokenizer, seq_len: int) -> list[Example]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if _eos(tokenizer) is not None:
        ids.append(_eos(tokenizer))
    chunks = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    return [Example(tuple(c), (True,) * len(c)) for c in chunks if len(c) >= 2]


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                 add_generation_prompt=True)
        return list(rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered)
    return list(tokenizer(prompt + "\n", add_special_tokens=False)["input_ids"])


def _record(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON ({exc.msg})") from None
    except (ValueError, RecursionError):  # an integer of over 4300 digits; nesting past the stack
        raise UsageError(f"{where}: not JSON this reader takes (a huge number or deep nesting)") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a line must be an object with \"prompt\" and \"response\"")
    for key in ("prompt", "response"):
        if not isinstance(record.get(key), str):
            raise UsageError(f"{where}: \"{key}\" must be a string (a line needs \"prompt\" and \"response\")")
        try:  # a JSON escape may name half a surrogate pair, which no tokenizer takes
            record[key].encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"{where}: \"{key}\" holds an unpaired surrogate escape (\\ud800-\\udfff)") from None
    return record


def jsonl_examples(text: str, tokenizer, seq_len: int, where: Path, stats: DataStats) -> list[Example]:
    examples = []
    # "\n" only: str.splitlines also splits at U+2028 and others, which JSON strings may hold raw.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        record = _record(line, f"{where}, line {number}")
        prompt = _prompt_ids(tokenizer, record["prompt"])
        response = list(tokenizer(record["response"], add_special_tokens=False)["input_ids"])
        if _eos(tokenizer) is not None:
            response.append(_eos(tokenizer))
        ids = (prompt + response)[:seq_len]
        if len(ids) < len(prompt) + len(response):
            stats.truncated += 1
        if len(ids) <= len(prompt):  # nothing of the response left to learn
            stats.dropped += 1
            continue
        examples.append(Example(tuple(ids), tuple(i >= len(prompt) for i in range(len(ids)))))
    return examples


def load_examples(path: Path, tokenizer, seq_len: int, stats: DataStats | None = None) -> list[Example]:
    """The examples of a data file (see the module docstring); UsageError for bad data."""
    if seq_len < 2:
        raise UsageError("the sequence length must be at least 2 tokens")
    if tokenizer is None:
        raise UsageError("this model has no tokenizer: it cannot read training text")
    stats = stats if stats is not None else DataStats()
    text = _read(path)
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl" or (suffix != ".txt" and text.lstrip().startswith("{")):
        examples = jsonl_examples(text, tokenizer, seq_len, Path(path), stats)
    else:
        examples = text_examples(text, tokenizer, seq_len)
    stats.examples = len(examples)
    if len(examples) < 2:
        raise UsageError(f"{path}: too little data: {len(examples)} example(s) of up to {seq_len} tokens; at least "
                         f"2 are needed (one is held out for evaluation)")
    return examples


def split_examples(examples: list[Example], *, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """(training, held out): a tenth (at least one) held out, chosen by `seed`."""
    order = list(range(len(examples)))
    random.Random(f"split/{seed}").shuffle(order)
    held = max(1, round(len(examples) * EVAL_SHARE))
    return [examples[i] for i in sorted(order[held:])], [examples[i] for i in sorted(order[:held])]


def batches(examples: list[Example], batch_size: int, pad_id: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[B, T] input ids and labels per batch of `batch_size` examples (the last may be
    smaller), T the batch's longest; labels[b, t] = ids[b, t + 1] where that target
    counts, else IGNORE; padding (after each row's tokens) counts nowhere."""
    out = []
    for start in range(0, len(examples), batch_size):
        group = examples[start:start + batch_size]
        length = max(len(e.ids) for e in group)
        ids = torch.full((len(group), length), pad_id, dtype=torch.long)
        labels = torch.full((len(group), length), IGNORE, dtype=torch.long)
        for row, example in enumerate(group):
            n = len(example.ids)
            ids[row, :n] = torch.tensor(example.ids)
            for t in range(n - 1):
                if example.counted[t + 1]:
                    labels[row, t] = example.ids[t + 1]
        out.append((ids, labels))
    return out


def count_targets(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())
