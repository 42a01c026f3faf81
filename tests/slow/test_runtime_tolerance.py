"""The tolerance between runtimes, measured: torch and ggml spans of SmolLM2's GGUF,
given the same real activations (the prompt's, then one token at a time), differ by
less than the protocol's cross-runtime tolerance for the gguf mode, with room to spare
(proofs/inference.py's ACROSS_RUNTIMES; the gguf mode's own 2e-2 is not enough: ggml
quantizes activations to 8 bits, torch rounds them to bfloat16)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from compushare.model.catalog import resolve_model
from compushare.model.head import ConsumerHead
from compushare.proofs.inference import GENESIS, relative_error, tolerance_between
from compushare.spans import GGML, TORCH, load_span

pytestmark = pytest.mark.slow

PROMPT = ("The history of computing is a story of machines that became smaller, faster and cheaper with every "
          "decade. In the beginning")
MORE = " there were rooms full of vacuum tubes and the programs"
MARGIN = 1.5  # the worst difference measured stays this far under the tolerance


def test_torch_and_ggml_spans_differ_within_the_cross_runtime_tolerance(tmp_path):
    store = resolve_model("smollm2-135m@gguf", tmp_path / "home")
    head = ConsumerHead.load(store.path)
    tokenizer = Tokenizer.from_file(str(store.path / "tokenizer.json"))
    steps = [tokenizer.encode(PROMPT).ids] + [[t] for t in tokenizer.encode(MORE).ids]
    worst = {}
    for start, end in ((0, 10), (10, 20), (20, 30)):
        before = load_span(store.path, 0, start, runtime=TORCH) if start else None
        spans = {rt: load_span(store.path, start, end, runtime=rt) for rt in (TORCH, GGML)}
        caches = {rt: span.new_cache() for rt, span in spans.items()} | {"before": before and before.new_cache()}
        position, errors = 0, []
        with torch.inference_mode():
            for ids in steps:
                hidden = head.embed_tokens(ids).reshape(1, len(ids), -1)
                if before is not None:  # the real activations a consumer sends this hop
                    hidden = before.forward(hidden, caches["before"], position)
                outputs = [spans[rt].forward(hidden, caches[rt], position).float().numpy() for rt in (TORCH, GGML)]
                errors.append(relative_error(*outputs))
                position += len(ids)
        allowed = tolerance_between("gguf", end - start, (spans[TORCH].build, GENESIS), (spans[GGML].build, GENESIS))
        worst[f"{start}:{end}"] = max(errors)
        assert max(errors) * MARGIN <= allowed, (start, end, errors, allowed)
    print("worst relative error, torch against ggml:", worst)
