"""Fine-tuning data (model/train_data.py): text cut into sequences, JSONL prompt/response
pairs with the loss on the response, the seeded held-out tenth, padded batches, and
clear UsageErrors for bad files. A word-level tokenizer (token i is "w<i>") makes the
expected ids plain; SmolLM2's own tokenizer and chat template, where the converted
SmolLM2 is in the test cache, check the real thing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from compushare.config import resolve_cache_dir
from compushare.errors import UsageError
from compushare.model.sources import SMOLLM2_CONVERTED
from compushare.model.train_data import (IGNORE, DataStats, Example, batches, count_targets, load_examples,
                                         split_examples)

pytestmark = pytest.mark.unit

EOS = 2
SMOLLM2 = resolve_cache_dir() / "converted" / SMOLLM2_CONVERTED
# A chat template of words: what the prompt's ids must be is plain to see.
WORD_TEMPLATE = ("{% for m in messages %}w10 {{ m['content'] }} w11 {% endfor %}"
                 "{% if add_generation_prompt %}w12{% endif %}")


def word_tokenizer(template: str | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": EOS, "<unk>": 3} | {f"w{i}": i for i in range(4, 256)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.chat_template = template
    return tokenizer


WORDS, TEMPLATED = word_tokenizer(), word_tokenizer(WORD_TEMPLATE)


@pytest.fixture(scope="module")
def smollm2():
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip(f"SmolLM2 not converted in {SMOLLM2} (tests/slow convert it)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOLLM2))


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def jsonl(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_text_is_cut_into_sequences_every_position_counted(tmp_path):
    path = write(tmp_path, "a.txt", words(*range(4, 15)) + "\n")  # 11 words and EOS: 5 + 5 + 2
    examples = load_examples(path, WORDS, 5)
    assert [e.ids for e in examples] == [(4, 5, 6, 7, 8), (9, 10, 11, 12, 13), (14, EOS)]
    assert all(all(e.counted) for e in examples)
    path = write(tmp_path, "b.txt", words(*range(4, 14)))  # 10 words and EOS: a last single token is dropped
    assert [len(e.ids) for e in load_examples(path, WORDS, 5)] == [5, 5]


def test_text_is_the_whole_tokenization_with_eos(tmp_path, smollm2):
    text = "The quick brown fox jumps over the lazy dog. " * 20 + "Ünïcode ✓ and\ttabs\r\nand lines."
    examples = load_examples(write(tmp_path, "story.md", text), smollm2, 16)
    ids = [i for e in examples for i in e.ids]
    assert ids == smollm2(text, add_special_tokens=False)["input_ids"] + [smollm2.eos_token_id]
    assert all(len(e.ids) == 16 for e in examples[:-1])


def test_jsonl_counts_the_response_and_eos_only(tmp_path):
    path = write(tmp_path, "d.jsonl", jsonl({"prompt": words(4, 5), "response": words(6, 7), "source": "extra keys"},
                                            {"prompt": words(8), "response": words(9)}))
    first, second = load_examples(path, WORDS, 16)
    assert first.ids == (4, 5, 6, 7, EOS) and first.counted == (False, False, True, True, True)
    assert second.ids == (8, 9, EOS) and first.targets == 3
    templated = load_examples(path, TEMPLATED, 16)[0]  # the prompt as a user turn, then the generation prompt
    assert templated.ids == (10, 4, 5, 11, 12, 6, 7, EOS) and templated.counted == (False,) * 5 + (True,) * 3


def test_jsonl_with_smollm2s_chat_template(tmp_path, smollm2):
    path = write(tmp_path, "d.jsonl", jsonl({"prompt": "What is 2+2?", "response": "4."},
                                            {"prompt": "Say hi", "response": "Hi!"}))
    first = load_examples(path, smollm2, 256)[0]
    prompt = list(smollm2.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=True,
                                              add_generation_prompt=True)["input_ids"])
    response = smollm2("4.", add_special_tokens=False)["input_ids"] + [smollm2.eos_token_id]
    assert list(first.ids) == prompt + response
    assert first.counted == (False,) * len(prompt) + (True,) * len(response)
    assert smollm2.decode(first.ids[:len(prompt)]).endswith("<|im_start|>assistant\n")


def test_long_examples_are_cut_and_those_without_response_dropped(tmp_path):
    records = [{"prompt": words(4, 5, 6), "response": words(7, 8, 9)},  # 3 + 4: cut to 5
               {"prompt": words(*range(4, 10)), "response": words(10)},  # prompt alone fills 5: dropped
               {"prompt": words(4), "response": words(5)},
               {"prompt": words(4, 5, 6, 7, 8), "response": words(9)}]  # dropped
    stats = DataStats()
    examples = load_examples(write(tmp_path, "d.jsonl", jsonl(*records)), WORDS, 5, stats)
    assert [e.ids for e in examples] == [(4, 5, 6, 7, 8), (4, 5, EOS)]
    assert (stats.examples, stats.dropped, stats.truncated) == (2, 2, 3)


def test_the_format_follows_the_suffix_then_the_first_character(tmp_path):
    record = jsonl({"prompt": words(4), "response": words(5)}) * 2
    assert len(load_examples(write(tmp_path, "d.data", record), WORDS, 8)) == 2  # sniffed: JSONL
    assert all(all(e.counted) for e in load_examples(write(tmp_path, "d.txt", record), WORDS, 2))  # .txt: text
    with pytest.raises(UsageError, match="line 1: not JSON"):  # .jsonl: JSONL, whatever it starts with
        load_examples(write(tmp_path, "e.jsonl", "w4 w5 w6\n" * 4), WORDS, 8)


def test_lines_are_numbered_as_an_editor_does(tmp_path):
    """Blank lines count, a byte-order mark and CRLF pass, and a JSON string's raw
    U+2028 (which str.splitlines would split at) stays inside its line."""
    text = ('\ufeff{"prompt": "w4\u2028w5", "response": "w6"}\r\n'  # line 1
            "\r\n\n"  # lines 2 and 3
            '{"prompt": "w4\u2028", "response": "w5"}\n'  # line 4
            "{\n")  # line 5
    path = write(tmp_path, "d.jsonl", text)
    with pytest.raises(UsageError, match=r"d\.jsonl, line 5: not JSON"):
        load_examples(path, WORDS, 8)
    path.write_bytes(path.read_bytes()[:-2])
    assert [e.ids for e in load_examples(path, WORDS, 8)] == [(4, 5, 6, EOS), (4, 5, EOS)]


@pytest.mark.parametrize("name, content, message", [
    ("missing.txt", None, "no such data file"),
    ("empty.txt", " \n\t\n", "empty"),
    ("d.jsonl", jsonl({"prompt": "w4", "response": "w5"}) + '{"prompt": "w4",\n', "line 2: not JSON"),
    ("d.jsonl", '{"prompt": "w4", "response": "w5"}\n["w4", "w5"]\n', "line 2: a line must be an object"),
    ("d.jsonl", '{"prompt": "w4"}\n', 'line 1: "response" must be a string'),
    ("d.jsonl", '{"prompt": 4, "response": "w5"}\n', 'line 1: "prompt" must be a string'),
    ("d.jsonl", '{"prompt": "w4", "response": "\\ud800"}\n', 'line 1: "response" holds an unpaired surrogate'),
    ("d.jsonl", "[" * 100_000 + "\n", "line 1: not JSON"),
    ("d.jsonl", '{"prompt": "w4", "response": "w5", "n": ' + "9" * 5000 + "}\n", "line 1: not JSON"),
    ("d.txt", b"w4 w5\nw6 w7\nw8 \xff\xfe\n", "line 3: not UTF-8"),
    ("d.txt", "w4", "too little data: 1 example"),  # w4 and EOS: one sequence
    ("d.jsonl", jsonl({"prompt": words(*range(4, 12)), "response": "w5"}) * 3, "too little data: 0 example"),
    ("d.jsonl", jsonl({"prompt": "w4", "response": "w5"}), "too little data: 1 example"),
])
def test_bad_data_is_refused_naming_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name if content is None else write(tmp_path, name, content)
    with pytest.raises(UsageError, match=message) as refused:
        load_examples(path, WORDS, 8)
    assert name in str(refused.value)


LINES = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=30), "response": st.text(max_size=30)},
                          optional={"other": st.integers()}).map(json.dumps),
    st.recursive(st.none() | st.booleans() | st.floats() | st.text(max_size=10),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                     st.sampled_from(["prompt", "response", "x"]), inner, max_size=3), max_leaves=6).map(json.dumps),
    st.text(max_size=40),
)


@given(st.lists(LINES, max_size=8), st.sampled_from(["d.jsonl", "d.txt", "d"]), st.integers(2, 12))
@example(['{"prompt": "a\\ud83d", "response": "b"}'] * 2, "d.jsonl", 8)
@example(['{"prompt": "\u2028", "response": "\u0085"}'] * 2, "d", 8)
def test_any_file_gives_examples_or_a_usage_error(tmp_path_factory, lines, name, seq_len):
    path = tmp_path_factory.mktemp("fuzz") / name
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    stats = DataStats()
    try:
        examples = load_examples(path, fuzz_tokenizer(), seq_len, stats)
    except UsageError:
        return
    assert len(examples) >= 2 and stats.examples == len(examples)
    for e in examples:
        assert 2 <= len(e.ids) <= seq_len and len(e.counted) == len(e.ids) and e.targets >= 1


def fuzz_tokenizer():
    """SmolLM2's where it is cached (a real BPE tokenizer and chat template), else the words."""
    global _FUZZ
    if _FUZZ is None:
        from transformers import AutoTokenizer

        _FUZZ = AutoTokenizer.from_pretrained(str(SMOLLM2)) if (SMOLLM2 / "tokenizer.json").exists() else TEMPLATED
    return _FUZZ


_FUZZ = None


def examples_of(count: int) -> list[Example]:
    return [Example((4 + i % 200, 4 + i // 200, 6), (True,) * 3) for i in range(count)]


@pytest.mark.parametrize("count, held", [(2, 1), (9, 1), (10, 1), (25, 2), (100, 10), (1001, 100)])
def test_a_seeded_tenth_is_held_out(count, held):
    examples = examples_of(count)
    train, evaluate = split_examples(examples, seed=7)
    assert len(evaluate) == held and len(train) == count - held
    assert sorted(map(id, train + evaluate)) == sorted(map(id, examples))  # every example, once
    assert [examples.index(e) for e in train] == sorted(examples.index(e) for e in train)  # in file order
    assert split_examples(examples, seed=7) == (train, evaluate)
    if count >= 100:
        assert split_examples(examples, seed=8)[1] != evaluate


def test_batches_are_right_padded_with_next_token_labels():
    examples = [Example((4, 5, 6, 7, EOS), (False, False, True, True, True)), Example((8, 9, EOS), (True,) * 3),
                Example((10, 11), (False, True))]
    (ids, labels), (last_ids, last_labels) = batches(examples, 2, pad_id=0)
    assert ids.tolist() == [[4, 5, 6, 7, EOS], [8, 9, EOS, 0, 0]] and ids.dtype == labels.dtype == torch.long
    assert labels.tolist() == [[IGNORE, 6, 7, EOS, IGNORE], [9, EOS, IGNORE, IGNORE, IGNORE]]
    assert last_ids.tolist() == [[10, 11]] and last_labels.tolist() == [[11, IGNORE]]
    assert count_targets(labels) + count_targets(last_labels) == sum(e.targets for e in examples) == 6
    # The loss of a batch: mean cross-entropy over its counted positions (padding counts nowhere).
    logits = torch.randn(2, 5, 256)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1), ignore_index=IGNORE)
    counted = labels != IGNORE
    by_hand = -torch.log_softmax(logits, -1)[counted].gather(1, labels[counted].unsqueeze(1)).mean()
    torch.testing.assert_close(loss, by_hand)
