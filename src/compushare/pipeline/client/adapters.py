"""A consumer's LoRA adapter as the hops of its chain need it.

Every session is opened with the slice of the adapter for its own blocks, tensors
included (a server keeps it for the session: pipeline/server/adapters.py), and its
server's step proofs name that slice's digest (proofs.inference.adapted_model). Hops, their
replacements, standbys and spot checks of one span share one slice, made once.
"""

from __future__ import annotations

from ...errors import UsageError
from ...model.lora import Adapter
from ...net.codec import DEFAULT_MAX_FRAME
from ..adapter_wire import adapter_to_wire

# An `open` is one frame: its slice of the adapter must leave room for the rest.
MAX_SLICE_BYTES = DEFAULT_MAX_FRAME - 64 * 1024


class AdapterSlices:
    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self._wire: dict[tuple[int, int], dict | None] = {}

    def wire(self, start: int, end: int) -> dict | None:
        """The `open`'s `adapter` for blocks start:end (None: the adapter has none of them)."""
        if (start, end) not in self._wire:
            part = self.adapter.span(start, end)
            if part.nbytes > MAX_SLICE_BYTES:
                raise UsageError(f"the adapter's layers {start}:{end} hold {part.nbytes} bytes, more than one "
                                 f"session's open carries ({MAX_SLICE_BYTES})")
            self._wire[(start, end)] = adapter_to_wire(part, with_tensors=True) if part.tensors else None
        return self._wire[(start, end)]

    def digest(self, start: int, end: int) -> bytes | None:
        wire = self.wire(start, end)
        return None if wire is None else wire["digest"]
