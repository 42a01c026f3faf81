"""The provider's HE worker: a child process that holds the span's encoded weights
and runs every encrypted product.

Why a process: TenSEAL's (SEAL's) deserialisers were not written for hostile
bytes. Every key and ciphertext a peer sends is parsed here, behind he/ckks.py's
checks; if one still crashes SEAL, the node loses this process (it restarts it and
answers the request with an error), not itself. It also keeps CKKS compute off the
node's event loop and out of its GIL.

The node talks to it over stdin/stdout: frames of a 4-byte big-endian length and a
msgpack map. Requests (one at a time):

    {"op": "load", "model_dir", "start", "end", "params", "preencode", "budget_bytes"}
        -> {"plaintexts", "bytes", "seconds", "preencoded"}
    {"op": "keys", "digest", "data"}       -> {"bytes"}
    {"op": "drop", "digest"}               -> {}
    {"op": "project", "digest", "layer", "group", "cts"}
        -> {"cts": [[bytes, ...] per token], "seconds"}

A failure is {"error": message}.
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import msgpack
import trio

from ...errors import CompushareError
from ...he.ckks import Context, HEError, keys_digest
from ...he.groups import GROUPS, ShapeConfig, group_weight, layer_prefix, preencoded_bytes, required_steps
from ...he.matvec import EncodedMatrix

log = logging.getLogger(__name__)

LENGTH = struct.Struct(">I")
MAX_WORKER_FRAME = 64 << 20
MAX_KEY_SETS = 8  # Galois key sets held at once (~24 MB each for SmolLM2)


class WorkerState:
    """What the worker process holds; `handle` answers one request. No I/O."""

    def __init__(self) -> None:
        self.context: Context | None = None
        self.span: tuple[int, int] | None = None
        self.weights: dict[tuple[int, str], object] = {}  # (layer, group) -> EncodedMatrix or raw weight
        self.preencode = True
        self.noise = 0.0  # fault injection (--debug-noise): a provider that lies
        self.steps: frozenset[int] = frozenset()
        self.keys: collections.OrderedDict[str, object] = collections.OrderedDict()

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        if op == "load":
            return self._load(request)
        if op == "keys":
            return self._keys(request)
        if op == "project":
            return self._project(request)
        if op == "drop":
            self.keys.pop(request.get("digest"), None)
            return {}
        raise HEError(f"unknown op {op!r}")

    def _load(self, request: dict) -> dict:
        import torch  # noqa: PLC0415

        from ...model.families import read_config  # noqa: PLC0415
        from ...model.weights import read_dense_tensors  # noqa: PLC0415

        torch.set_num_threads(1)
        began = time.perf_counter()
        start, end = int(request["start"]), int(request["end"])
        config = ShapeConfig.of(read_config(request["model_dir"]))  # config.json: no transformers in this process
        self.context = Context(request["params"])
        self.steps = required_steps(config, self.context.slots)
        prefixes = tuple(layer_prefix(i) for i in range(start, end))
        # A quantized model's products are encrypted with its dequantized weights.
        state = read_dense_tensors(request["model_dir"], lambda names: [n for n in names if n.startswith(prefixes)
                                                                       and n.endswith("_proj.weight")])
        state = {k: v.float().numpy() for k, v in state.items()}
        # Pre-encoded weights come out of the node's memory budget: when the span's do
        # not fit what is left of it, the weights are encoded per request instead.
        p = self.context.params
        need = preencoded_bytes(config, self.context.slots, p.poly_degree, len(p.coeff_bits) - 1) * (end - start)
        budget = request.get("budget_bytes")
        self.preencode = bool(request.get("preencode", True)) and (budget is None or need <= budget)
        self.weights.clear()
        plaintexts = nbytes = 0
        for layer in range(start, end):
            for group in GROUPS:
                weight = group_weight(state, layer, group)
                if self.preencode:
                    encoded = EncodedMatrix(self.context, weight)
                    plaintexts += encoded.plaintexts
                    nbytes += encoded.nbytes
                    self.weights[(layer, group)] = encoded
                else:
                    self.weights[(layer, group)] = weight
                    nbytes += weight.nbytes
        self.span = (start, end)
        self.noise = float(request.get("noise", 0.0))
        return {"plaintexts": plaintexts, "bytes": nbytes, "seconds": time.perf_counter() - began,
                "preencoded": self.preencode, "preencode_bytes": need}

    def _keys(self, request: dict) -> dict:
        if self.context is None:
            raise HEError("no span loaded")
        data = request["data"]
        digest = request["digest"]
        if keys_digest(data) != digest:
            raise HEError("Galois keys do not match their digest")
        if digest not in self.keys:  # the node bounds how many (HEWorker: MAX_KEY_SETS)
            self.keys[digest] = self.context.galois_keys_from(data, self.steps)
        return {"bytes": len(data)}

    def _project(self, request: dict) -> dict:
        if self.context is None or self.span is None:
            raise HEError("no span loaded")
        keys = self.keys.get(request["digest"])
        if keys is None:
            raise HEError("unknown keys: send them first")
        layer, group = int(request["layer"]), request["group"]
        if not self.span[0] <= layer < self.span[1] or group not in GROUPS:
            raise HEError(f"layer {layer} group {group!r} is not served here (span {self.span[0]}:{self.span[1]})")
        began = time.perf_counter()
        matrix = self.weights[(layer, group)]
        if not isinstance(matrix, EncodedMatrix):  # encoding on the fly: slower, far less memory
            matrix = EncodedMatrix(self.context, matrix)
        inputs = [self.context.ciphertext_from(data) for data in request["cts"]]  # all checked before any work
        outs = [[self.context.dump(self._lie(ct)) for ct in matrix.apply(self.context, keys, ct)] for ct in inputs]
        return {"cts": outs, "seconds": time.perf_counter() - began}


    def _lie(self, ct):
        """With fault injection on, add Gaussian noise of `noise` (absolute: a liar
        cannot see the values) to every slot of a product."""
        if self.noise > 0:
            import numpy as np  # noqa: PLC0415

            context = self.context
            plain = context.seal.Plaintext()
            noise = np.random.default_rng().normal(0.0, self.noise, context.slots)
            context.encoder.encode(noise.tolist(), ct.parms_id(), ct.scale, plain)
            context.evaluator.add_plain_inplace(ct, plain)
        return ct


def _read_exact(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def serve_stdio() -> None:
    """The worker's main loop."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    state = WorkerState()
    while True:
        header = _read_exact(stdin, LENGTH.size)
        if header is None:
            return
        (size,) = LENGTH.unpack(header)
        if size > MAX_WORKER_FRAME:
            return
        body = _read_exact(stdin, size)
        if body is None:
            return
        try:
            reply = {"ok": state.handle(msgpack.unpackb(body, raw=False))}
        except HEError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # the node decides; the worker keeps serving
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out = msgpack.packb(reply, use_bin_type=True)
        stdout.write(LENGTH.pack(len(out)) + out)
        stdout.flush()


class WorkerCrashed(CompushareError):
    """The HE worker process died (or broke the framing) during a request."""


class HEWorker:
    """The node's handle on its worker process: one request at a time, restarted
    (and reloaded, with the key sets it held) after a crash."""

    def __init__(self, model_dir, *, params: str, preencode: bool = True,
                 budget_bytes: Callable[[tuple[int, int]], int | None] = lambda span: None,
                 noise: float = 0.0) -> None:
        self.model_dir, self.params, self.preencode = str(model_dir), params, preencode
        self.noise = noise
        self.budget_bytes = budget_bytes  # what the node's memory budget leaves for a span's encoded weights
        self.process: trio.Process | None = None
        self.span: tuple[int, int] | None = None
        self.loaded: dict = {}
        self.restarts = 0
        self._buffer = bytearray()
        self._lock = trio.Lock()
        self._keys: collections.OrderedDict[str, bytes] = collections.OrderedDict()

    async def _spawn(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "compushare.pipeline.server.private_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buffer.clear()

    async def _call(self, request: dict, timeout_s: float) -> dict:
        if self.process is None:
            await self._spawn()
        data = msgpack.packb(request, use_bin_type=True)
        try:
            with trio.fail_after(timeout_s):
                await self.process.stdin.send_all(LENGTH.pack(len(data)) + data)
                header = await self._receive(LENGTH.size)
                (size,) = LENGTH.unpack(header)
                if size > MAX_WORKER_FRAME:
                    raise WorkerCrashed(f"worker sent a {size}-byte frame")
                reply = msgpack.unpackb(await self._receive(size), raw=False)
        except (trio.BrokenResourceError, trio.ClosedResourceError, WorkerCrashed, trio.TooSlowError,
                ValueError) as exc:
            await self._kill()
            self.restarts += 1
            raise WorkerCrashed(f"HE worker lost during {request.get('op')}: {exc!r}") from None
        if "error" in reply:
            raise HEError(reply["error"])
        return reply["ok"]

    async def _receive(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = await self.process.stdout.receive_some(1 << 20)
            if not chunk:
                raise WorkerCrashed(f"worker exited (code {self.process.poll()})")
            self._buffer += chunk
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def _kill(self) -> None:
        process, self.process = self.process, None
        self.span = None
        if process is not None:
            with trio.move_on_after(5):
                process.kill()
                await process.wait()

    async def _ensure(self, span: tuple[int, int]) -> None:
        if self.span == span and self.process is not None:
            return
        self.loaded = await self._call({"op": "load", "model_dir": self.model_dir, "start": span[0], "end": span[1],
                                        "params": self.params, "preencode": self.preencode,
                                        "budget_bytes": self.budget_bytes(span), "noise": self.noise},
                                       timeout_s=600)
        self.span = span
        for digest, data in list(self._keys.items()):  # what a crashed worker held
            await self._call({"op": "keys", "digest": digest, "data": data}, timeout_s=60)
        log.info("HE worker holds blocks %d:%d %s: %d plaintexts, %.0f MB, in %.1fs", span[0], span[1],
                 "pre-encoded" if self.loaded["preencoded"] else
                 f"to encode per request (pre-encoding needs {self.loaded['preencode_bytes'] / 1e6:.0f} MB, "
                 f"over the memory budget)", self.loaded["plaintexts"], self.loaded["bytes"] / 1e6,
                 self.loaded["seconds"])

    async def load(self, span: tuple[int, int]) -> dict:
        async with self._lock:
            await self._ensure(span)
            return self.loaded

    async def add_keys(self, span: tuple[int, int], digest: str, data: bytes) -> None:
        async with self._lock:
            await self._ensure(span)
            await self._call({"op": "keys", "digest": digest, "data": data}, timeout_s=60)
            self._keys[digest] = data
            while len(self._keys) > MAX_KEY_SETS:  # least recently used out
                await self._drop(next(iter(self._keys)))

    def has_keys(self, digest: str) -> bool:
        return digest in self._keys

    async def forget_keys(self, digest: str) -> None:
        """Drop a key set (its owner sent a newer one)."""
        async with self._lock:
            await self._drop(digest)

    async def _drop(self, digest: str) -> None:
        self._keys.pop(digest, None)
        if self.process is not None:
            await self._call({"op": "drop", "digest": digest}, timeout_s=30)

    async def project(self, span: tuple[int, int], digest: str, layer: int, group: str,
                      cts: list[bytes]) -> tuple[list[list[bytes]], float]:
        async with self._lock:
            await self._ensure(span)
            if digest not in self._keys:
                raise HEError("unknown keys: send them first")
            self._keys.move_to_end(digest)
            reply = await self._call({"op": "project", "digest": digest, "layer": layer, "group": group,
                                      "cts": cts}, timeout_s=120 + 10 * len(cts))
            return reply["cts"], reply["seconds"]

    @property
    def held_bytes(self) -> int:
        """Memory the worker holds for this node: encoded weights and key sets."""
        return int(self.loaded.get("bytes", 0)) + sum(len(k) for k in self._keys.values()) * 2

    async def aclose(self) -> None:
        await self._kill()


def main() -> None:
    # A worker must never write anything but frames to stdout.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serve_stdio()


if __name__ == "__main__":
    main()
