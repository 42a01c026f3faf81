"""pipeline/client/grammar.py and generate(): the mask applied before every choice, a
verify pass's drafts too. A copying model (it favours the token that followed the
last one before, plus seeded noise) over Qwen2.5's 151,936-token vocabulary, through a
chain that can rewind: with speculation on and off the output is the same, token for
token, and always valid."""

from __future__ import annotations

import json

import pytest
import torch

from compushare.app.api.tools import Hermes, parse_tools
from compushare.pipeline.client.generate import GenerateStats, generate
from compushare.pipeline.client.grammar import (Constraint, check_grammar, drafts_allowed, grammar_tokenizer,
                                                json_schema_grammar)
from compushare.pipeline.client.sampling import SamplingParams
from compushare.errors import UsageError
from helpers import QWEN_VOCAB

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "mood": {"enum": ["happy", "sad", "calm"]},
    "place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
    "required": ["name", "mood", "place", "tags"], "additionalProperties": False}
DOCUMENT = {"name": "Ada", "mood": "calm", "place": {"city": "London"}, "tags": ["math", "engines"]}


class CopyingModel:
    """A chain and a head at once: logits from the whole context, so a rewind and a
    verify pass see what one-token steps see."""

    def __init__(self, vocab: int, noise: float, seed: int = 0) -> None:
        self.vocab, self.noise, self.seed = vocab, noise, seed
        self.history: list[int] = []

    def _logits(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(hash((self.seed, *self.history[-4:], len(self.history))) % 2**62)
        logits = torch.randn(self.vocab, generator=generator) * self.noise
        last = self.history[-1]
        earlier = [i for i in range(len(self.history) - 1) if self.history[i] == last]
        if earlier:
            logits[self.history[earlier[-1] + 1]] += 10.0
        return logits

    def embed_tokens(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.float32)

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = []
        for token in hidden.long().tolist():
            self.history.append(token)
            rows.append(self._logits())
        return torch.stack(rows)

    async def rewind(self, position: int) -> None:
        del self.history[position:]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[-1].clone()

    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.clone()


@pytest.fixture(scope="module")
def llg_tokenizer(qwen_tokenizer):
    return grammar_tokenizer(qwen_tokenizer, QWEN_VOCAB, frozenset({qwen_tokenizer.eos_token_id}))


async def _generate(tokenizer, llg, grammar, prompt, *, speculate, noise=1.0, seed=0, temperature=0.0,
                    max_new=120):
    model = CopyingModel(QWEN_VOCAB, noise, seed)
    stats = GenerateStats()
    constraint = Constraint(llg, grammar)
    tokens = await generate(model, model, tokenizer.encode(prompt), SamplingParams(
        temperature=temperature, seed=seed, max_new_tokens=max_new), eos_ids=frozenset({tokenizer.eos_token_id}),
        speculate=speculate, stats=stats, constraint=constraint)
    return tokens, stats, constraint


@pytest.mark.parametrize("seed", range(4))
async def test_speculation_on_and_off_give_the_same_valid_output(qwen_tokenizer, llg_tokenizer, seed):
    import jsonschema

    grammar = json_schema_grammar(SCHEMA)
    prompt = f"Copy this: {json.dumps(DOCUMENT)} and this: {json.dumps(dict(DOCUMENT, mood='sad'))} "
    plain, _, _ = await _generate(qwen_tokenizer, llg_tokenizer, grammar, prompt, speculate=False, seed=seed)
    fast, stats, constraint = await _generate(qwen_tokenizer, llg_tokenizer, grammar, prompt, speculate=True,
                                              seed=seed)
    assert fast == plain and constraint.complete
    assert stats.accepted > 0 and stats.drafted > stats.accepted  # drafts kept, and some rejected
    text = qwen_tokenizer.decode(plain, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)


async def test_sampling_at_any_temperature_stays_valid(qwen_tokenizer, llg_tokenizer):
    import jsonschema

    grammar = json_schema_grammar(SCHEMA)
    for seed in range(3):
        tokens, _, constraint = await _generate(qwen_tokenizer, llg_tokenizer, grammar, "Say something: ",
                                                speculate=seed % 2 == 0, noise=3.0, seed=seed, temperature=1.5,
                                                max_new=400)
        jsonschema.validate(json.loads(qwen_tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
        assert constraint.complete


async def test_a_cut_generation_is_not_complete(qwen_tokenizer, llg_tokenizer):
    tokens, _, constraint = await _generate(qwen_tokenizer, llg_tokenizer, json_schema_grammar(SCHEMA),
                                            f"Copy: {json.dumps(DOCUMENT)} ", speculate=True, max_new=5)
    assert len(tokens) == 5 and not constraint.complete


def test_a_forbidden_draft_ends_the_drafts_and_the_state_is_kept(qwen_tokenizer, llg_tokenizer):
    constraint = Constraint(llg_tokenizer, json_schema_grammar({"type": "object"}))
    brace, text = qwen_tokenizer.encode("{"), qwen_tokenizer.encode("hello")
    rows = torch.zeros(3, QWEN_VOCAB)
    assert drafts_allowed(rows, brace + text, constraint) == brace
    assert rows[0, brace[0]] == 0 and rows[0, text[0]] == float("-inf")  # row 0: only an object may begin
    assert torch.isinf(rows[1]).sum() > 0 and not torch.isinf(rows[2]).any()  # row 2 never looked at
    assert constraint.try_take(brace[0])  # the state was put back: "{" is still next


def test_a_required_tool_call_follows_its_schema(qwen_tokenizer, llg_tokenizer):
    tools = parse_tools([{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}])
    constraint = Constraint(llg_tokenizer, Hermes().calls_grammar(tools, parallel=True))
    good = qwen_tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert constraint.matcher.validate_tokens(good) == len(good)
    bad = qwen_tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": "one"')
    assert constraint.matcher.validate_tokens(bad) < len(bad)


def test_a_schema_that_cannot_be_enforced_is_refused(llg_tokenizer):
    with pytest.raises(UsageError, match="cannot be enforced"):
        check_grammar(json_schema_grammar({"type": "object", "properties": {"a": {"type": "frobnicate"}}}),
                      llg_tokenizer)


def test_the_llama3_format_renders_tools_and_enforces_its_call(qwen_tokenizer, llg_tokenizer):
    """Llama 3.1's template (tests/data/tokenizers) over tools, a call and its result;
    its call grammar: one JSON object naming a tool, with valid parameters."""
    import copy
    from pathlib import Path

    from compushare.app.api.engine import messages_to_ids
    from compushare.app.api.tools import Llama3, call_format
    from helpers import WEATHER_TOOL

    tokenizer = copy.copy(qwen_tokenizer)  # any tokenizer renders the template's text
    tokenizer.chat_template = (Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "llama3.1.jinja"
                               ).read_text()
    tools = parse_tools([WEATHER_TOOL])
    assert isinstance(call_format(tokenizer.chat_template), Llama3)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    text = tokenizer.decode(messages_to_ids(tokenizer, messages, tools))
    assert '"name": "get_weather"' in text and '"parameters": {"city": "Oslo"}' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"-3 C"<|eot_id|>' in text
    constraint = Constraint(llg_tokenizer, Llama3().calls_grammar(tools, parallel=False))
    good = qwen_tokenizer.encode('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert constraint.matcher.validate_tokens(good) == len(good)
    bad = qwen_tokenizer.encode('{"name": "get_time", "parameters": {}}')
    assert constraint.matcher.validate_tokens(bad) < len(bad)
