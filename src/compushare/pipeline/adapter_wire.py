"""A LoRA adapter on the wire, and the adapters a server holds for its peers.

    {"digest": 32 bytes, "spec": {"rank", "alpha", "targets", "rslora"},
     "tensors": {name: tensor} | absent}

A request names its adapter by digest (model/lora.py: over the spec and every
tensor) and carries the tensors the first time; a server keeps what it was sent in
an AdapterCache, per peer, bounded in count and bytes, and answers `unknown_adapter`
for a digest it does not hold, so the consumer sends the tensors again. Decoding
checks everything before a tensor is built: names (a projection of a layer inside
the request's span), shapes (they must fit the model), dtype float32, finite
values, and that the tensors hash to the digest claimed.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import torch

from ..errors import FrameError
from ..model.lora import Adapter, LoraSpec, parse_name, projection_shapes
from ..net.tensors import encode_tensor
from ..wire import BAD_ADAPTER, UNKNOWN_ADAPTER

DIGEST_BYTES = 32
MAX_ADAPTER_TENSORS = 4096


def adapter_to_wire(adapter: Adapter, *, with_tensors: bool) -> dict:
    wire = {"digest": adapter.digest(), "spec": adapter.spec.to_wire()}
    if with_tensors:
        wire["tensors"] = {name: encode_tensor(t.detach().float().contiguous()) for name, t in
                           adapter.tensors.items()}
    return wire


def _tensor(name: str, obj: object, shape: tuple[int, int]) -> torch.Tensor:
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise FrameError(BAD_ADAPTER, f"{name}: a tensor is a map of exactly dtype, shape, data")
    if obj["dtype"] != "float32" or obj["shape"] != list(shape) or not isinstance(obj["data"], bytes) \
            or len(obj["data"]) != math.prod(shape) * 4:
        raise FrameError(BAD_ADAPTER, f"{name}: must be float32 {list(shape)}")
    tensor = torch.from_numpy(np.frombuffer(obj["data"], dtype="<f4").reshape(shape).copy())
    if not torch.isfinite(tensor).all():
        raise FrameError(BAD_ADAPTER, f"{name}: holds NaN or infinity")
    return tensor


def decode_adapter(obj: object, config, start: int, end: int, cache: AdapterCache | None, peer: str
                   ) -> Adapter:
    """The adapter a request names, for layers start..end-1 of a model of `config`:
    decoded from the request (and kept in `cache`), or found in `cache` by digest."""
    if not isinstance(obj, dict) or not {"digest", "spec"} <= set(obj) <= {"digest", "spec", "tensors"}:
        raise FrameError(BAD_ADAPTER, "an adapter is a map of digest, spec and (the first time) tensors")
    digest = obj["digest"]
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise FrameError(BAD_ADAPTER, "an adapter's digest is 32 bytes")
    try:
        spec = LoraSpec.from_wire(obj["spec"])
    except (ValueError, TypeError) as exc:
        raise FrameError(BAD_ADAPTER, f"adapter spec: {exc}") from None
    if "tensors" not in obj:
        held = cache.get(peer, digest) if cache is not None else None
        if held is None:
            raise FrameError(UNKNOWN_ADAPTER, "this server holds no adapter with that digest: send its tensors")
        return held.span(start, end)
    tensors = obj["tensors"]
    if not isinstance(tensors, dict) or len(tensors) > MAX_ADAPTER_TENSORS:
        raise FrameError(BAD_ADAPTER, f"an adapter's tensors are a map of at most {MAX_ADAPTER_TENSORS}")
    shapes, decoded = projection_shapes(config), {}
    for name, value in tensors.items():
        try:
            layer, module, which = parse_name(name) if isinstance(name, str) else parse_name("")
        except ValueError as exc:
            raise FrameError(BAD_ADAPTER, str(exc)) from None
        if not start <= layer < end:
            raise FrameError(BAD_ADAPTER, f"{name}: layer {layer} is outside the span {start}:{end}")
        if module not in spec.modules:
            raise FrameError(BAD_ADAPTER, f"{name}: {module} is not among the spec's targets")
        out_features, in_features = shapes[module]
        decoded[name] = _tensor(name, value, (spec.rank, in_features) if which == "A" else (out_features, spec.rank))
    try:
        adapter = Adapter(spec, decoded)
    except ValueError as exc:
        raise FrameError(BAD_ADAPTER, str(exc)) from None
    if adapter.digest() != digest:
        raise FrameError(BAD_ADAPTER, "the adapter's tensors do not hash to its digest")
    if cache is not None:
        cache.put(peer, digest, adapter)
    return adapter


class AdapterCache:
    """Adapters sent by each peer, by digest: at most `per_peer` of one peer's (the
    least recently used goes first) and `total_bytes` of everyone's."""

    def __init__(self, per_peer: int = 4, total_bytes: int = 256 * 1024 * 1024) -> None:
        self.per_peer, self.total_bytes = per_peer, total_bytes
        self._held: collections.OrderedDict[tuple[str, bytes], Adapter] = collections.OrderedDict()
        self.bytes = 0

    def get(self, peer: str, digest: bytes) -> Adapter | None:
        adapter = self._held.get((peer, digest))
        if adapter is not None:
            self._held.move_to_end((peer, digest))
        return adapter

    def put(self, peer: str, digest: bytes, adapter: Adapter) -> None:
        if adapter.nbytes > self.total_bytes:
            raise FrameError(BAD_ADAPTER, f"an adapter of {adapter.nbytes} bytes exceeds this server's "
                                          f"{self.total_bytes} for adapters")
        if (peer, digest) in self._held:
            self._held.move_to_end((peer, digest))
            return
        self._held[(peer, digest)] = adapter
        self.bytes += adapter.nbytes
        mine = [key for key in self._held if key[0] == peer]
        for key in mine[:max(0, len(mine) - self.per_peer)]:
            self._drop(key)
        while self.bytes > self.total_bytes:
            self._drop(next(iter(self._held)))

    def _drop(self, key: tuple[str, bytes]) -> None:
        self.bytes -= self._held.pop(key).nbytes

    def __len__(self) -> int:
        return len(self._held)
