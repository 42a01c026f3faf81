"""The training corpus (named by the sha256 of its uncompressed bytes) and the minibatch
sampler every participant can recompute: a participant's minibatches derive from public
values only (the recipe's seed, the run id, the peer id, the round and the step), so
anyone holding the corpus can re-run a participant's round and check its pseudo-gradient.

The tokenizer is byte-level: a byte is a token, so a sequence is a window of corpus bytes.
Pure, no I/O (except Corpus.load, which reads the given file).
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compushare.diloco.recipe import Recipe

EVAL_BYTES = 65536  # the corpus's last bytes: held out for evaluation
MINIBATCH_DOMAIN = b"compushare/diloco/minibatch/v1"


@dataclass(frozen=True)
class Corpus:
    """A corpus's bytes, split into train (all but the tail) and eval (the tail)."""

    digest: str  # sha256 hex of the uncompressed bytes
    train: np.ndarray  # uint8
    eval: np.ndarray  # uint8

    @classmethod
    def from_bytes(cls, data: bytes, *, eval_bytes: int = EVAL_BYTES) -> Corpus:
        if not 0 < eval_bytes < len(data) // 2:
            raise ValueError(f"a corpus of {len(data)} bytes is too small to hold out {eval_bytes} for eval")
        array = np.frombuffer(data, dtype=np.uint8)
        return cls(digest=hashlib.sha256(data).hexdigest(), train=array[:-eval_bytes], eval=array[-eval_bytes:])

    @classmethod
    def load(cls, path: str | Path, *, eval_bytes: int = EVAL_BYTES) -> Corpus:
        """A corpus from a file, gunzipped if its name ends in .gz."""
        path = Path(path)
        raw = path.read_bytes()
        return cls.from_bytes(gzip.decompress(raw) if path.suffix == ".gz" else raw, eval_bytes=eval_bytes)


def minibatch_seed(recipe_seed: int, run_id: str, peer: str, round: int, step: int) -> int:
    """The sampler's seed for one inner step of one participant:

        message = b"compushare/diloco/minibatch/v1" || 0x00
                  || u64be(recipe.seed)
                  || u32be(len(run_id_utf8)) || run_id_utf8
                  || u32be(len(peer_utf8)) || peer_utf8
                  || u64be(round) || u64be(step)
        seed = int.from_bytes(sha256(message), "big")     (a 256-bit non-negative int)

    Lengths prefix the strings so that no two inputs give the same message."""
    parts = [MINIBATCH_DOMAIN, b"\x00", recipe_seed.to_bytes(8, "big")]
    for text in (run_id, peer):
        raw = text.encode("utf-8")
        parts += [len(raw).to_bytes(4, "big"), raw]
    parts += [round.to_bytes(8, "big"), step.to_bytes(8, "big")]
    return int.from_bytes(hashlib.sha256(b"".join(parts)).digest(), "big")


def sample_windows(train: np.ndarray, seed: int, batch: int, seq_len: int) -> torch.Tensor:
    """`batch` windows of seq_len + 1 bytes from `train`, at start offsets drawn as

        rng = np.random.Generator(np.random.PCG64(seed))
        starts = rng.integers(0, len(train) - seq_len, size=batch, dtype=np.int64)

    (numpy's high is exclusive: every start leaves room for seq_len + 1 bytes). Returns a
    LongTensor (batch, seq_len + 1): inputs are [:, :-1], targets [:, 1:]."""
    if len(train) <= seq_len:
        raise ValueError(f"a training split of {len(train)} bytes holds no window of {seq_len + 1}")
    rng = np.random.Generator(np.random.PCG64(seed))
    starts = rng.integers(0, len(train) - seq_len, size=batch, dtype=np.int64)
    windows = np.stack([train[s:s + seq_len + 1] for s in starts])
    return torch.from_numpy(windows.astype(np.int64))


def minibatch(corpus: Corpus, recipe: Recipe, *, run_id: str, peer: str, round: int, step: int) -> torch.Tensor:
    """A participant's minibatch for one inner step: (recipe.batch, recipe.seq_len + 1) byte ids,
    from the seed `minibatch_seed(recipe.seed, run_id, peer, round, step)`."""
    seed = minibatch_seed(recipe.seed, run_id, peer, round, step)
    return sample_windows(corpus.train, seed, recipe.batch, recipe.seq_len)


def single_minibatch(corpus: Corpus, recipe: Recipe, *, global_batch: int, step: int,
                     seed_label: str = "single") -> torch.Tensor:
    """The one-process baseline's minibatch: the same sampler with run_id = seed_label,
    peer = "single", round = 0, and global_batch sequences."""
    seed = minibatch_seed(recipe.seed, seed_label, "single", 0, step)
    return sample_windows(corpus.train, seed, global_batch, recipe.seq_len)


def eval_batches(corpus: Corpus, recipe: Recipe, count: int) -> list[torch.Tensor]:
    """`count` fixed eval batches of (recipe.batch, seq_len + 1): the eval split cut into
    consecutive, non-overlapping windows from its start, taken in order."""
    width = recipe.seq_len + 1
    needed = count * recipe.batch * width
    if needed > len(corpus.eval):
        raise ValueError(f"{count} eval batches need {needed} bytes; the eval split holds {len(corpus.eval)}")
    windows = corpus.eval[:needed].astype(np.int64).reshape(count, recipe.batch, width)
    return [torch.from_numpy(windows[i].copy()) for i in range(count)]
