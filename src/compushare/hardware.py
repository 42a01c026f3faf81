"""What this machine offers: usable CPU cores, RAM, and a GPU if torch sees one.

`Hardware` is a wire record too (a node may advertise it), so `from_wire` is strict.
A CUDA device's name carries its compute capability ("cuda:NVIDIA H100 80GB HBM3
cc9.0"): the wire record keeps its fields. `Accelerator` is the local view of a
CUDA device (its memory free now too): a node serving on CUDA sizes its span and
KV budget by it (`compute_memory`). torch is imported only inside the functions
that read a device: importing it costs seconds.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import psutil

from .errors import UsageError

MAX_WIRE_INT = 2**40
MAX_GPU_NAME = 64
WIRE_KEYS = frozenset({"cpu", "ram_mb", "free_mb", "gpu", "gpu_mb"})
MB = 2**20

# Where a container (cgroup namespace) sees its own CPU quota: v2, then v1.
CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


@dataclasses.dataclass(frozen=True)
class Hardware:
    cpu_cores: int  # logical CPUs this process may use (affinity, cgroup quota)
    ram_mb: int  # total RAM
    ram_free_mb: int  # RAM available now, without swapping
    gpu: str | None  # "cuda:<device name>", "mps", or None
    gpu_mb: int  # total GPU memory, 0 if no GPU or unknown

    def __post_init__(self) -> None:
        for name in ("cpu_cores", "ram_mb", "ram_free_mb", "gpu_mb"):
            value = getattr(self, name)
            # type() rather than isinstance(): bool is an int subclass.
            if type(value) is not int or not 0 <= value < MAX_WIRE_INT:
                raise ValueError(f"hardware {name} must be an int in [0, 2**40), got {value!r}")
        if self.cpu_cores < 1:
            raise ValueError("hardware cpu_cores must be at least 1")
        if self.ram_free_mb > self.ram_mb:
            raise ValueError(f"hardware free RAM {self.ram_free_mb} MB exceeds total {self.ram_mb} MB")
        if self.gpu is None:
            if self.gpu_mb:
                raise ValueError("hardware gpu_mb must be 0 when there is no gpu")
        elif type(self.gpu) is not str or not 1 <= len(self.gpu) <= MAX_GPU_NAME:
            raise ValueError(f"hardware gpu must be None or a string of 1..{MAX_GPU_NAME} characters")

    def to_wire(self) -> dict:
        return {"cpu": self.cpu_cores, "ram_mb": self.ram_mb, "free_mb": self.ram_free_mb,
                "gpu": self.gpu, "gpu_mb": self.gpu_mb}

    @classmethod
    def from_wire(cls, obj) -> Hardware:
        """Raise ValueError unless `obj` is exactly what `to_wire` produces."""
        if not isinstance(obj, dict):
            # ValueError like every other malformed input: callers catch one kind.
            raise ValueError(f"hardware must be a map, got {type(obj).__name__}")  # noqa: TRY004
        if set(obj) != WIRE_KEYS:
            missing, unexpected = WIRE_KEYS - set(obj), len(set(obj) - WIRE_KEYS)
            raise ValueError(f"hardware keys must be exactly {sorted(WIRE_KEYS)}: "
                             f"missing {sorted(missing)}, {unexpected} unexpected")
        return cls(cpu_cores=obj["cpu"], ram_mb=obj["ram_mb"], ram_free_mb=obj["free_mb"],
                   gpu=obj["gpu"], gpu_mb=obj["gpu_mb"])


def quota_cores(quota: int, period: int) -> int | None:
    """CPUs a CFS quota allows (rounded up), or None when unlimited (quota <= 0)."""
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def _cgroup_cpu_limit() -> int | None:
    """The container's CPU quota. Only the namespace root is read: that is where
    Docker and Kubernetes put the limit; quotas on host systemd slices are rare."""
    try:
        if CGROUP_V2_CPU_MAX.exists():
            quota, period = CGROUP_V2_CPU_MAX.read_text().split()
            return None if quota == "max" else quota_cores(int(quota), int(period))
        if CGROUP_V1_QUOTA.exists():
            return quota_cores(int(CGROUP_V1_QUOTA.read_text()), int(CGROUP_V1_PERIOD.read_text()))
    except (OSError, ValueError):
        pass  # unreadable or unexpected format: no known limit
    return None


def usable_cpu_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # macOS and Windows have no affinity call
        cores = psutil.cpu_count(logical=True) or 1
    limit = _cgroup_cpu_limit()
    return max(1, min(cores, limit) if limit else cores)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """A CUDA device, as this process sees it now."""

    index: int
    name: str  # torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3"
    total_mb: int
    free_mb: int  # free now (cudaMemGetInfo): what other processes hold is not
    capability: tuple[int, int]  # compute capability (9, 0)

    @property
    def label(self) -> str:
        """Hardware.gpu's text: "cuda:<name> cc<major>.<minor>", the name cut to fit MAX_GPU_NAME."""
        suffix = f" cc{self.capability[0]}.{self.capability[1]}"
        return f"cuda:{self.name}"[:MAX_GPU_NAME - len(suffix)] + suffix


def cuda_accelerator(index: int = 0) -> Accelerator | None:
    """CUDA device `index` as torch sees it; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return Accelerator(index=index, name=str(torch.cuda.get_device_name(index)), total_mb=int(total) // MB,
                       free_mb=min(int(free), int(total)) // MB,
                       capability=(int(properties.major), int(properties.minor)))


def resolve_device(requested: str, cuda_available: bool) -> str:
    """The device a node serves on, from --device: "cuda" or "cpu" ("auto": CUDA where
    torch sees it). UsageError for CUDA asked of a machine without it."""
    if requested not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cuda" and not cuda_available:
        raise UsageError("--device cuda, but torch sees no CUDA device (a CPU-only torch, or no driver): "
                         "use --device cpu")
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    return requested


def compute_memory(device: str, hardware: Hardware, accelerator: Accelerator | None) -> tuple[int, int]:
    """(total MB, free MB) of the memory a node's span lives in: the CUDA device's for
    a node serving on CUDA, the RAM's otherwise."""
    if device == "cuda":
        if accelerator is None:
            raise UsageError("serving on CUDA, but no CUDA device was found")
        return accelerator.total_mb, accelerator.free_mb
    return hardware.ram_mb, hardware.ram_free_mb


def _detect_gpu() -> tuple[str | None, int]:
    import torch

    accelerator = cuda_accelerator()
    if accelerator is not None:
        return accelerator.label, accelerator.total_mb
    if torch.backends.mps.is_available():
        # MPS shares system RAM; Metal's recommended working-set size is the share a
        # process should plan on, rather than total RAM counted a second time.
        return "mps", torch.mps.recommended_max_memory() // MB
    return None, 0


def detect_hardware() -> Hardware:
    memory = psutil.virtual_memory()
    ram_mb = memory.total // MB
    gpu, gpu_mb = _detect_gpu()
    return Hardware(cpu_cores=usable_cpu_cores(), ram_mb=ram_mb, ram_free_mb=min(memory.available // MB, ram_mb),
                    gpu=gpu, gpu_mb=gpu_mb)


def available_ram_mb(hardware: Hardware) -> int:
    """RAM available now (for a fresh ad), never above the total `hardware` reported."""
    return min(psutil.virtual_memory().available // MB, hardware.ram_mb)
