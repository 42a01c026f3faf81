"""What serving on CUDA needs that a CPU can check: device detection (torch.cuda faked),
--device, the budget on the device, the kernel table's choices, the int4 planes CUDA
kernels are built from (run through the CPU int4 kernel, which computes the same
(c - 8) * scale + zero), and the device argument's plumbing on CPU. The device's own
tests are tests/gpu (marked gpu)."""

from __future__ import annotations

import types

import pytest
import torch

from compushare.config import NodeConfig
from compushare.errors import UsageError
from compushare.hardware import (MAX_GPU_NAME, Accelerator, Hardware, compute_memory, cuda_accelerator,
                                 detect_hardware, resolve_device)
from compushare.model import kernels
from compushare.model.blocks import SpanRunner
from compushare.model.device import to_device, to_host
from compushare.model.quantize import dequantize, quantize_int8, quantize_q4
from compushare.pipeline.server.provider import weights_budget_mb

GIB = 2**30


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as on a machine with one H100 (70 of 80 GiB free)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=0: types.SimpleNamespace(major=9, minor=0, total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=0: (70 * GIB, 80 * GIB))


def test_cuda_device_is_detected_with_its_memory_and_capability(fake_cuda):
    accelerator = cuda_accelerator()
    assert accelerator == Accelerator(index=0, name="NVIDIA H100 80GB HBM3", total_mb=80 * 1024,
                                      free_mb=70 * 1024, capability=(9, 0))
    hardware = detect_hardware()
    assert hardware.gpu == "cuda:NVIDIA H100 80GB HBM3 cc9.0"
    assert hardware.gpu_mb == 80 * 1024
    assert Hardware.from_wire(hardware.to_wire()) == hardware  # the ad's record takes it


def test_no_cuda_no_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_accelerator() is None


def test_a_long_device_name_keeps_its_capability_within_the_wire_limit():
    label = Accelerator(0, "X" * 100, 1, 1, (8, 6)).label
    assert len(label) == MAX_GPU_NAME and label.startswith("cuda:XXX") and label.endswith(" cc8.6")


@pytest.mark.parametrize(("requested", "available", "resolved"), [
    ("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"), ("cuda", True, "cuda")])
def test_resolve_device(requested, available, resolved):
    assert resolve_device(requested, available) == resolved


@pytest.mark.parametrize(("requested", "message"), [("cuda", "no CUDA device"), ("gpu", "auto, cpu or cuda")])
def test_resolve_device_refuses(requested, message):
    with pytest.raises(UsageError, match=message):
        resolve_device(requested, False)


def test_node_config_device(tmp_path):
    assert NodeConfig.build(tmp_path).device == "auto"
    (tmp_path / "config.toml").write_text('[node]\ndevice = "cpu"\n')
    assert NodeConfig.build(tmp_path).device == "cpu"
    assert NodeConfig.build(tmp_path, device="cuda").device == "cuda"  # the flag over the file
    with pytest.raises(UsageError, match="--device"):
        NodeConfig.build(tmp_path, device="tpu")


def test_the_budget_of_a_cuda_node_is_the_devices(fake_cuda):
    hardware = Hardware(cpu_cores=4, ram_mb=16_000, ram_free_mb=9_000, gpu=None, gpu_mb=0)
    accelerator = cuda_accelerator()
    assert compute_memory("cuda", hardware, accelerator) == (80 * 1024, 70 * 1024)
    assert compute_memory("cpu", hardware, accelerator) == (16_000, 9_000)
    with pytest.raises(UsageError):
        compute_memory("cuda", hardware, None)
    # By default most of the device's free memory, half of the RAM's; a budget given is the budget.
    assert weights_budget_mb(None, 70 * 1024, 0, "cuda") == int(70 * 1024 * 0.8)
    assert weights_budget_mb(None, 9_000, 400) == 4_500
    assert weights_budget_mb(20_000, 70 * 1024, 500, "cuda") == 19_500


def test_the_kernel_table_chooses_per_device():
    weight = torch.randn(64, 256)
    q4, int8 = quantize_q4(weight, 64, steps=2), quantize_int8(weight)
    assert kernels.kernel_for("cuda", q4) is kernels._q4_cuda
    assert kernels.kernel_for("cuda", int8) is kernels._int8_cuda
    assert kernels.kernel_for("cpu", q4) is kernels._q4_cpu
    # A device type with no kernels registered gets every format dequantized, correct anywhere.
    assert kernels.kernel_for("mps", q4) is kernels.DequantizedLinear
    assert kernels.kernel_for("mps", int8) is kernels.DequantizedLinear
    for kind in ("Q4_0", "Q4_K", "Q5_K", "Q8_0", "Q6_K", "F16"):
        assert ("cuda", f"gguf:{kind}") in kernels.KERNELS
    dense = kernels.kernel_for("mps", {"": torch.zeros(16, 34, dtype=torch.uint8)}, "Q8_0")
    assert isinstance(dense({"": torch.zeros(16, 34, dtype=torch.uint8)}), kernels.DenseLinear)


@pytest.mark.parametrize(("in_features", "tiles"), [(4096, 8), (14336, 8), (576, 4), (1568, 2), (1000, None)])
def test_inner_k_tiles(in_features, tiles):
    assert kernels.inner_k_tiles(in_features) == tiles


def test_cuda_int4_fits():
    assert kernels.cuda_int4_fits(14336, 4096, 64)
    assert not kernels.cuda_int4_fits(14332, 4096, 64)  # rows in tiles of 8
    assert not kernels.cuda_int4_fits(64, 4096, 16)  # no group of 16
    assert not kernels.cuda_int4_fits(64, 1000, 32)  # no k-tile divides it


def _cpu_int4_product(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
                      planes: int) -> torch.Tensor:
    """What the CUDA kernel computes from these planes, through the CPU kernel of the same formula."""
    flat = x.to(kernels.ACTIVATION)
    if planes == 2:
        flat = torch.cat([flat, flat], dim=-1)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, kernels.pack_int4(codes), group, scales_and_zeros).float()


def test_int8_as_two_int4_planes_gives_the_int8_weights():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 512, generator=generator) * 0.05
    parts = quantize_int8(weight)
    group = next(g for g in kernels.CUDA_INT4_GROUPS if 512 % g == 0)
    codes, scales_and_zeros = kernels.int8_as_int4_planes(parts[""], parts["_scale"], group)
    assert codes.shape == (128, 1024) and int(codes.max()) <= 15
    # Plane by plane, the weights the kernel sees add up to q * scale (the scale in bfloat16).
    held = parts["_scale"].to(kernels.ACTIVATION).float().unsqueeze(1)
    scales, zeros = scales_and_zeros[..., 0].float().t(), scales_and_zeros[..., 1].float().t()
    per_weight = (codes.float() - 8) * scales.repeat_interleave(group, 1) + zeros.repeat_interleave(group, 1)
    assert torch.equal(per_weight[:, :512] + per_weight[:, 512:], parts[""].float() * held)
    x = torch.randn(3, 512, generator=generator)
    expected = x.to(kernels.ACTIVATION).float() @ (parts[""].float() * held).t()
    got = _cpu_int4_product(x, codes, scales_and_zeros, group, 2)
    assert float((got - expected).abs().max() / expected.abs().max()) < 0.01


def test_q4_planes_give_the_q4_weights():
    generator = torch.Generator().manual_seed(1)
    parts = quantize_q4(torch.randn(64, 256, generator=generator) * 0.05, 64, steps=2)
    from compushare.model.quantize import unpack_nibbles

    codes, scales_and_zeros = kernels.int4_planes(unpack_nibbles(parts[""]), parts["_scale"].float(),
                                                  parts["_min"].float(), 1)
    x = torch.randn(2, 256, generator=generator)
    expected = x.to(kernels.ACTIVATION).float() @ dequantize(parts).t()
    got = _cpu_int4_product(x, codes, scales_and_zeros, 64, 1)
    assert float((got - expected).abs().max() / expected.abs().max()) < 0.01


def test_cuda_pack_argument_forms():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = kernels._cuda_pack_argument(codes, "uint8")
    assert packed.tolist() == [[0x12, 0x34, 0xF0, 0x78]]  # element 2j in the high nibble
    assert kernels._cuda_pack_argument(codes, "int32").dtype == torch.int32


def test_edges_on_cpu_are_the_tensor_itself():
    hidden = torch.randn(1, 3, 8)
    assert to_device(hidden, torch.device("cpu")) is hidden
    assert to_host(hidden) is hidden


def test_span_on_cpu_named_as_default(tiny_model):
    default = SpanRunner.load(tiny_model, 0, 2)
    named = SpanRunner.load(tiny_model, 0, 2, device="cpu")
    assert named.device == torch.device("cpu") == default.device
    assert all(t.device.type == "cpu" for layer in named.layers.values() for t in layer.state_dict().values())
    hidden = torch.randn(1, 4, named.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(named.forward(hidden, named.new_cache(), 0), default.forward(hidden, default.new_cache(), 0))


def test_a_span_asked_of_a_missing_device_fails_before_serving(tiny_model):
    """A CUDA span on a machine without CUDA: a clear error at load, not a wrong answer."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises((RuntimeError, AssertionError)):
        SpanRunner.load(tiny_model, 0, 1, device="cuda")
