"""A LoRA adapter on the wire (pipeline/adapter_wire.py): a round trip through msgpack,
malformed maps refused with bad_adapter or unknown_adapter and nothing else, and the
bounds of a server's AdapterCache."""

from __future__ import annotations

import copy
import math
import struct

import msgpack
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from compushare.errors import FrameError
from compushare.model.lora import Adapter, LoraSpec
from compushare.pipeline.adapter_wire import AdapterCache, adapter_to_wire, decode_adapter
from compushare.wire import BAD_ADAPTER, UNKNOWN_ADAPTER
from helpers import random_adapter

pytestmark = pytest.mark.unit

PEER = "peer-a"
START, END = 1, 3  # the span every request here names


class Config:  # the tiny Llama's shapes (tests/helpers.py make_tiny_llama): all projection_shapes reads
    hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, num_hidden_layers = 64, 4, 2, 128, 4


CONFIG = Config()
ADAPTER = random_adapter(CONFIG, targets=("q_proj", "v_proj", "down_proj"), seed=2, model_id="m")
SLICE = ADAPTER.span(START, END)


def wire(adapter: Adapter = SLICE, *, with_tensors: bool = True) -> dict:
    """What a request carries, after msgpack as a frame would (bytes stay bytes)."""
    return msgpack.unpackb(msgpack.packb(adapter_to_wire(adapter, with_tensors=with_tensors)), raw=False,
                           strict_map_key=False)


def test_an_adapter_round_trips_and_is_then_named_by_digest_alone():
    cache = AdapterCache()
    decoded = decode_adapter(wire(), CONFIG, START, END, cache, PEER)
    assert decoded.spec == SLICE.spec and decoded.digest() == SLICE.digest() and decoded.layers == [1, 2]
    assert all(torch.equal(decoded.tensors[k], v) for k, v in SLICE.tensors.items())
    again = decode_adapter(wire(with_tensors=False), CONFIG, START, END, cache, PEER)
    assert again.digest() == SLICE.digest() and len(cache) == 1
    # A sub-span of what it holds, for a request over fewer layers.
    assert decode_adapter(wire(with_tensors=False), CONFIG, 2, 3, cache, PEER).layers == [2]
    # Held per peer: another peer naming the digest must send the tensors itself.
    with pytest.raises(FrameError) as refused:
        decode_adapter(wire(with_tensors=False), CONFIG, START, END, cache, "peer-b")
    assert refused.value.code == UNKNOWN_ADAPTER


def nan_bytes(count: int, at: int, value: float) -> bytes:
    data = bytearray(struct.pack(f"<{count}f", *([0.0] * count)))
    data[at * 4:at * 4 + 4] = struct.pack("<f", value)
    return bytes(data)


A_NAME = "model.layers.1.self_attn.q_proj.lora_A.weight"
JUNK = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1) | st.floats() | st.text(max_size=8)
                    | st.binary(max_size=40),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)


def _mutations(draw) -> list:
    """(what is wrong, a function that makes a valid wire map so)."""
    name = draw(st.sampled_from(sorted(SLICE.tensors)))
    at = draw(st.integers(0, SLICE.tensors[name].numel() - 1))
    bad_float = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    junk = draw(JUNK)
    key = draw(st.sampled_from(["digest", "spec", "tensors"]))
    spec_key, spec_value = draw(st.sampled_from(["rank", "alpha", "targets", "rslora"])), draw(JUNK)

    def rename(w, new):
        w["tensors"][new] = w["tensors"].pop(name)

    return [
        lambda w: w["tensors"][name].update(dtype=draw(st.sampled_from(["float16", "bfloat16", "int8", "f32"]))),
        lambda w: w["tensors"][name].update(shape=list(reversed(w["tensors"][name]["shape"]))),
        lambda w: w["tensors"][name].update(data=w["tensors"][name]["data"][:-4]),
        lambda w: w["tensors"][name].update(data=nan_bytes(SLICE.tensors[name].numel(), at, bad_float)),
        lambda w: w["tensors"][name].update(extra=1),
        lambda w: w["tensors"].__setitem__(name, junk),
        lambda w: rename(w, name.replace("layers.1.", "layers.0.").replace("layers.2.", "layers.3.")),  # outside
        lambda w: rename(w, name.replace("self_attn.q_proj", "self_attn.k_proj").replace("mlp.down_proj",
                                                                                       "mlp.up_proj")),
        lambda w: rename(w, name.replace(".weight", ".bias")),
        lambda w: rename(w, 7),
        lambda w: w["tensors"].pop(name),  # half a pair
        lambda w: w.update(digest=bytes(32) if w["digest"] != bytes(32) else b"\x01" * 32),
        lambda w: w.update(digest=w["digest"][:31]),
        lambda w: w["spec"].update({spec_key: spec_value}),
        lambda w: w["spec"].update(rank=w["spec"]["rank"] * 2),
        lambda w: w.update({key: junk}),
        lambda w: w.pop(key),
        lambda w: w.update(extra=junk),
    ]


@st.composite
def malformed(draw):
    w = copy.deepcopy(wire())
    mutations = _mutations(draw)
    for index in draw(st.lists(st.integers(0, len(mutations) - 1), min_size=1, max_size=3)):
        try:
            mutations[index](w)
        except (KeyError, AttributeError, TypeError):
            pass  # an earlier mutation took away what this one changes
    return w


@given(malformed())
@example({"digest": SLICE.digest(), "spec": SLICE.spec.to_wire()})  # unknown digest, no tensors
@example(42)
def test_malformed_adapters_are_refused_as_adapter_errors_only(obj):
    cache = AdapterCache()
    try:
        decoded = decode_adapter(obj, CONFIG, START, END, cache, PEER)
    except FrameError as exc:
        assert exc.code in (BAD_ADAPTER, UNKNOWN_ADAPTER), exc
        assert len(cache) == 0
        return
    # A mutation that left the map valid (junk equal to what it replaced): then it is the adapter.
    assert decoded.digest() == SLICE.digest() and len(cache) == 1


@pytest.mark.parametrize("damage, code", [
    (lambda w: w.pop("tensors"), UNKNOWN_ADAPTER),
    (lambda w: w["tensors"][A_NAME].update(data=nan_bytes(4 * 64, 5, math.nan)), BAD_ADAPTER),
    (lambda w: w["tensors"][A_NAME].update(dtype="float16"), BAD_ADAPTER),
    (lambda w: w.update(digest=bytes(32)), BAD_ADAPTER),
])
def test_each_refusal_names_its_code(damage, code):
    w = wire()
    damage(w)
    with pytest.raises(FrameError) as refused:
        decode_adapter(w, CONFIG, START, END, AdapterCache(), PEER)
    assert refused.value.code == code


def test_a_layer_outside_the_span_is_refused():
    with pytest.raises(FrameError, match="outside the span") as refused:
        decode_adapter(wire(ADAPTER), CONFIG, START, END, None, PEER)  # the whole adapter for a 1:3 request
    assert refused.value.code == BAD_ADAPTER


def adapters(count: int, *, rank: int = 2) -> list[Adapter]:
    return [random_adapter(CONFIG, range(1), seed=seed, rank=rank, targets=("q_proj",)) for seed in range(count)]


def test_the_cache_keeps_each_peers_most_recently_used():
    cache, held = AdapterCache(per_peer=3), adapters(5)
    for adapter in held[:3]:
        cache.put(PEER, adapter.digest(), adapter)
    cache.put("peer-b", held[4].digest(), held[4])
    assert cache.get(PEER, held[0].digest()) is held[0]  # used: now the most recent
    cache.put(PEER, held[3].digest(), held[3])
    assert cache.get(PEER, held[1].digest()) is None  # the least recently used of PEER's went
    assert all(cache.get(PEER, a.digest()) is a for a in (held[0], held[2], held[3]))
    assert cache.get("peer-b", held[4].digest()) is held[4]  # another peer's stays
    cache.put(PEER, held[3].digest(), held[3])  # again: held once
    assert len(cache) == 4 and cache.bytes == sum(a.nbytes for a in (*held[2:], held[0]))


def test_the_cache_bounds_everyones_bytes():
    held = adapters(4)
    size = held[0].nbytes
    cache = AdapterCache(per_peer=10, total_bytes=int(2.5 * size))
    for peer, adapter in zip("abcd", held):
        cache.put(peer, adapter.digest(), adapter)
        assert cache.bytes <= cache.total_bytes
    assert len(cache) == 2 and cache.get("a", held[0].digest()) is None and cache.get("d", held[3].digest())
    big = random_adapter(CONFIG, range(4), rank=8, targets=("q_proj", "v_proj"))
    with pytest.raises(FrameError) as refused:
        cache.put("e", big.digest(), big)
    assert refused.value.code == BAD_ADAPTER and len(cache) == 2


def test_spec_from_the_wire_is_strict():
    spec = LoraSpec(4, 8.0, ("v_proj", "q_proj"))
    assert LoraSpec.from_wire(spec.to_wire()) == spec and spec.targets == ("q_proj", "v_proj")
    for bad in ({**spec.to_wire(), "rank": True}, {**spec.to_wire(), "rank": 0}, {**spec.to_wire(), "alpha": -1.0},
                {**spec.to_wire(), "targets": ["q_proj", "q_proj"]}, {**spec.to_wire(), "targets": "q_proj"},
                {**spec.to_wire(), "rslora": 1}, {**spec.to_wire(), "extra": 1}, [4, 8.0]):
        with pytest.raises(ValueError):
            LoraSpec.from_wire(bad)
