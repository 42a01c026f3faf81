"""hardware.py: detection on this machine, and the strict wire record."""

from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from compushare.hardware import (
    MAX_GPU_NAME,
    MAX_WIRE_INT,
    Hardware,
    detect_hardware,
    quota_cores,
)

GOOD = {"cpu": 4, "ram_mb": 16_000, "free_mb": 9_000, "gpu": "cuda:NVIDIA GeForce RTX 3060", "gpu_mb": 12_288}


def test_detect_hardware_is_sane_here():
    hardware = detect_hardware()
    assert hardware.cpu_cores >= 1
    if hasattr(os, "sched_getaffinity"):
        assert hardware.cpu_cores <= len(os.sched_getaffinity(0))
    assert 0 < hardware.ram_mb
    assert 0 <= hardware.ram_free_mb <= hardware.ram_mb
    assert hardware.gpu is None or hardware.gpu == "mps" or hardware.gpu.startswith("cuda:")
    assert Hardware.from_wire(hardware.to_wire()) == hardware


@st.composite
def hardware_records(draw) -> Hardware:
    ram = draw(st.integers(0, MAX_WIRE_INT - 1))
    gpu = draw(st.none() | st.text(min_size=1, max_size=MAX_GPU_NAME))
    return Hardware(
        cpu_cores=draw(st.integers(1, MAX_WIRE_INT - 1)),
        ram_mb=ram,
        ram_free_mb=draw(st.integers(0, ram)),
        gpu=gpu,
        gpu_mb=0 if gpu is None else draw(st.integers(0, MAX_WIRE_INT - 1)),
    )


@given(hardware_records())
def test_wire_round_trip_through_msgpack(hardware):
    raw = msgpack.packb(hardware.to_wire(), use_bin_type=True)
    assert Hardware.from_wire(msgpack.unpackb(raw, raw=False, strict_map_key=True)) == hardware


def test_good_record_parses():
    assert Hardware.from_wire(GOOD) == Hardware(4, 16_000, 9_000, "cuda:NVIDIA GeForce RTX 3060", 12_288)


@pytest.mark.parametrize("changes, message", [
    ({"extra": 1}, "keys must be exactly"),
    ({"cpu": None}, "cpu_cores"),
    ({"cpu": True}, "cpu_cores"),
    ({"cpu": 0}, "at least 1"),
    ({"cpu": 2.0}, "cpu_cores"),
    ({"ram_mb": -1}, "ram_mb"),
    ({"ram_mb": "16000"}, "ram_mb"),
    ({"ram_mb": MAX_WIRE_INT, "free_mb": 0}, "ram_mb"),
    ({"free_mb": False}, "ram_free_mb"),
    ({"free_mb": 16_001}, "exceeds total"),
    ({"gpu_mb": -5}, "gpu_mb"),
    ({"gpu_mb": True}, "gpu_mb"),
    ({"gpu": None}, "no gpu"),
    ({"gpu": ""}, "gpu must be"),
    ({"gpu": "x" * (MAX_GPU_NAME + 1)}, "gpu must be"),
    ({"gpu": b"cuda"}, "gpu must be"),
    ({"gpu": 3}, "gpu must be"),
])
def test_from_wire_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        Hardware.from_wire(GOOD | changes)


def test_from_wire_rejects_missing_key_and_non_maps():
    with pytest.raises(ValueError, match="missing \\['gpu_mb'\\]"):
        Hardware.from_wire({k: v for k, v in GOOD.items() if k != "gpu_mb"})
    with pytest.raises(ValueError, match="must be a map"):
        Hardware.from_wire(list(GOOD.items()))


@pytest.mark.parametrize("quota, period, cores", [
    (-1, 100_000, None),  # v1: unlimited
    (200_000, 100_000, 2),
    (150_000, 100_000, 2),  # 1.5 CPUs: round up, threads can still use the fraction
    (10_000, 100_000, 1),
    (100_000, 0, None),
])
def test_quota_cores(quota, period, cores):
    assert quota_cores(quota, period) == cores
