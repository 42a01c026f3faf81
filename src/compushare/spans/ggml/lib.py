"""ggml through ggml-python's ctypes bindings, with their wrong declarations fixed.

ggml-python (pinned in pyproject.toml; tools/install_ggml.py builds its bindings over
the ggml llama-cpp-python's sdist vendors, llama.cpp's own, for the machine's CPU)
declares some functions' return type as a `typing.NewType` over int instead of a
pointer: ctypes then reads the C pointer as a 32-bit int and hands back a truncated
address, and the next call with it segfaults. `fixed()` re-declares every such
function before anything calls it; `RETURNS_POINTER` lists the handle types it
found wrong in 0.0.45. Import ggml from here, never directly.

The CPU backend's extra buffer types (CPU_REPACK: weights rearranged at load for
the machine's SIMD, as llama.cpp does) are not exported as a function: they come
from `ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts")`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging

import ggml as _ggml

RETURNS_POINTER = ("ggml_backend_buffer_t", "ggml_backend_buffer_type_t", "ggml_backend_t")


def misdeclared(module=_ggml) -> list[str]:
    """Functions whose declared return type is not a ctypes type (so not a pointer
    either): what `fixed` re-declares."""
    wrong = []
    for name in dir(module):
        function = getattr(module, name)
        if isinstance(function, ctypes._CFuncPtr) and function.restype is not None:
            if not (isinstance(function.restype, type) and issubclass(function.restype, ctypes._SimpleCData.__mro__[1])):
                wrong.append(name)
    return sorted(wrong)


FIXED: list[str] = []  # what fixed() re-declared


@functools.cache
def fixed():
    """The ggml module, every function returning a handle declared as a pointer."""
    for name in misdeclared(_ggml):
        FIXED.append(name)
        function = getattr(_ggml, name)
        kind = getattr(function.restype, "__name__", "")
        if kind not in RETURNS_POINTER:
            raise RuntimeError(f"ggml-python declares {name} returning {kind!r}: not a known handle type")
        function.restype = ctypes.c_void_p
    return _ggml


ggml = fixed()
log = logging.getLogger("compushare.ggml")
_LEVELS = {2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}  # GGML_LOG_LEVEL_INFO/WARN/ERROR; debug, cont: debug


@ggml.ggml_log_callback
def _to_logging(level: int, text: bytes, _user_data) -> None:
    # ggml prints to stderr unless told otherwise: one line per repacked tensor at load.
    message = text.decode(errors="replace").rstrip()
    if message:
        log.log(_LEVELS.get(level, logging.DEBUG), "%s", message)


ggml.ggml_log_set(_to_logging, None)  # the callback object lives as long as the module

_EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


def cpu_device() -> int:
    device = ggml.ggml_backend_dev_by_type(ggml.GGML_BACKEND_DEVICE_TYPE_CPU)
    if not device:
        raise RuntimeError("ggml has no CPU device")
    return device


def cpu_extra_buffer_types() -> dict[str, int]:
    """The CPU backend's extra buffer types by name ({"CPU_REPACK": buft} where the
    build has repacked kernels for this CPU); {} where it offers none."""
    device = cpu_device()
    reg = ggml.ggml_backend_dev_backend_reg(device)
    address = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return {}
    array = _EXTRA_BUFTS(address)(device)
    found: dict[str, int] = {}
    i = 0
    while array and array[i]:
        found[ggml.ggml_backend_buft_name(array[i]).decode()] = array[i]
        i += 1
    return found


_FEATURE = type("_Feature", (ctypes.Structure,), {"_fields_": [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]})
_GET_FEATURES = ctypes.CFUNCTYPE(ctypes.POINTER(_FEATURE), ctypes.c_void_p)


def cpu_features() -> dict[str, str]:
    """What the CPU backend was built with and uses (SIMD sets, REPACK, ...)."""
    reg = ggml.ggml_backend_dev_backend_reg(cpu_device())
    address = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
    if not address:
        return {}
    array = _GET_FEATURES(address)(reg)
    found, i = {}, 0
    while array and array[i].name:
        found[array[i].name.decode()] = (array[i].value or b"").decode()
        i += 1
    return found


@functools.cache
def build_id() -> str:
    """"ggml/<version>:<8 hex>": ggml's version and a digest of the CPU kernels it
    runs (the features the backend reports, its thread runtime aside). Two nodes of
    one build compute the same span bit for bit (threads do not change a result,
    measured); another build (AVX-512 against AVX2, another repacking) may round
    differently."""
    features = sorted(f"{k}={v}" for k, v in cpu_features().items() if k != "OPENMP")
    digest = hashlib.sha256("|".join(features).encode()).hexdigest()[:8]
    return f"ggml/{ggml.ggml_version().decode()}:{digest}"
