"""model/selfbench.py: the block-rate benchmark on the tiny model, and its cache."""

from __future__ import annotations

import json
import math

import pytest
import torch

from compushare.model.selfbench import (
    CACHE_FILE,
    cache_key,
    cached_block_rate,
    measure_block_rate,
)
from compushare.model.store import ModelStore


class CountingMeasure:
    """The real benchmark (kept short), recording each call's thread count and device."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.devices: list[str] = []

    def __call__(self, model_dir, *, threads, device):
        self.calls.append(threads)
        self.devices.append(device)
        return measure_block_rate(model_dir, steps=2, warmup=1, threads=threads, device=device)


@pytest.fixture
def model(tiny_model, tmp_path):
    return ModelStore(tmp_path / "data").import_dir(tiny_model, alias="tiny")


def test_measure_block_rate_is_positive_and_finite(tiny_model):
    rate = measure_block_rate(tiny_model)
    assert math.isfinite(rate) and rate > 0


def test_measure_caps_blocks_at_model_size_and_restores_threads(tiny_model):
    before = torch.get_num_threads()
    rate = measure_block_rate(tiny_model, blocks=100, steps=2, threads=1)  # the tiny model has 4 blocks
    assert math.isfinite(rate) and rate > 0
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("kwargs", [{"blocks": 0}, {"steps": 0}, {"warmup": -1}])
def test_measure_rejects_bad_arguments(tiny_model, kwargs):
    with pytest.raises(ValueError):
        measure_block_rate(tiny_model, **kwargs)


def test_cached_rate_measures_once(model, tmp_path):
    measure = CountingMeasure()
    first = cached_block_rate(model, tmp_path / "cache", threads=1, measure=measure)
    second = cached_block_rate(model, tmp_path / "cache", threads=1, measure=measure)
    assert measure.calls == [1]
    assert second == first
    stored = json.loads((tmp_path / "cache" / CACHE_FILE).read_text())
    assert stored["rates"] == {cache_key(model.model_id, 1): first}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [CACHE_FILE]  # no temp files left


def test_device_is_measured_and_keyed(model, tmp_path):
    """A rate measured on CPU is not a CUDA node's: the device goes to the benchmark
    and into the key (a CPU key stays as it was, so earlier caches still hold)."""
    measure = CountingMeasure()
    cached_block_rate(model, tmp_path, threads=1, measure=measure, device="cpu")
    assert measure.devices == ["cpu"]
    assert cache_key(model.model_id, 1, "cpu") == cache_key(model.model_id, 1)
    assert cache_key(model.model_id, 1, "cuda").endswith("|device=cuda")
    assert cache_key(model.model_id, 1, "cuda") != cache_key(model.model_id, 1)


def test_other_thread_count_is_another_entry(model, tmp_path):
    measure = CountingMeasure()
    for threads in (1, 2, 1, 2):
        cached_block_rate(model, tmp_path, threads=threads, measure=measure)
    assert measure.calls == [1, 2]
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())["rates"]) == 2


@pytest.mark.parametrize("content", [
    b"\xff\xfe not utf-8",
    b'{"version": 1, "rates": ',
    b"[]",
    b'{"version": 99, "rates": {}}',
    b'{"version": 1, "rates": []}',
])
def test_corrupt_cache_is_remeasured(model, tmp_path, content):
    path = tmp_path / CACHE_FILE
    path.write_bytes(content)
    measure = CountingMeasure()
    rate = cached_block_rate(model, tmp_path, threads=1, measure=measure)
    assert measure.calls == [1]
    assert json.loads(path.read_text())["rates"] == {cache_key(model.model_id, 1): rate}


@pytest.mark.parametrize("bad_rate", ["fast", -3.0, 0.0, None, True])
def test_invalid_cached_rate_is_remeasured(model, tmp_path, bad_rate):
    key = cache_key(model.model_id, 1)
    (tmp_path / CACHE_FILE).write_text(json.dumps({"version": 1, "rates": {key: bad_rate, "other": 5.0}}))
    measure = CountingMeasure()
    rate = cached_block_rate(model, tmp_path, threads=1, measure=measure)
    assert measure.calls == [1]
    assert json.loads((tmp_path / CACHE_FILE).read_text())["rates"] == {key: rate, "other": 5.0}


def test_unwritable_cache_dir_still_returns_the_rate(model, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    measure = CountingMeasure()
    rate = cached_block_rate(model, not_a_dir, threads=1, measure=measure)
    assert rate > 0 and measure.calls == [1]
