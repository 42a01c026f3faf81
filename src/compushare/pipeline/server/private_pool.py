"""The node's HE workers: n processes (private_worker.py) sharing one span's products.

Worker i of n holds share i of every product's (output, giant step) pairs, so the
span's encoded weights are held once, split n ways, and a product runs on n cores
at once: every worker rotates the request's inputs and computes its pairs; worker
0 then adds the parts of each output (exact: the answer is the same ciphertext,
byte for byte, as one worker's). n is the node's compute threads.

Each process answers one request at a time over stdin/stdout (frames of a 4-byte
big-endian length and a msgpack map); one that dies or breaks the framing is
killed and started again, reloaded with the key sets it held, on the next request.
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
from collections.abc import Callable

import msgpack
import trio

from ...errors import CompushareError
from ...he.ckks import HEError
from .private_worker import LENGTH, MAX_WORKER_FRAME

log = logging.getLogger(__name__)

MAX_KEY_SETS = 8  # Galois key sets held at once (13.5 MB each for SmolLM2)
MAX_WORKERS = 16


class WorkerCrashed(CompushareError):
    """An HE worker process died (or broke the framing) during a request."""


class _Process:
    """One worker process and its framing."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: trio.Process | None = None
        self.span: tuple[int, int] | None = None
        self.loaded: dict = {}
        self._buffer = bytearray()

    async def call(self, request: dict, timeout_s: float) -> dict:
        if self.process is None:
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            self.process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "compushare.pipeline.server.private_worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            self._buffer.clear()
        data = msgpack.packb(request, use_bin_type=True)
        try:
            with trio.fail_after(timeout_s):
                await self.process.stdin.send_all(LENGTH.pack(len(data)) + data)
                (size,) = LENGTH.unpack(await self._receive(LENGTH.size))
                if size > MAX_WORKER_FRAME:
                    raise WorkerCrashed(f"worker sent a {size}-byte frame")
                reply = msgpack.unpackb(await self._receive(size), raw=False)
            if not isinstance(reply, dict) or ("ok" not in reply and "error" not in reply):
                raise WorkerCrashed("worker sent no answer")
        except (trio.BrokenResourceError, trio.ClosedResourceError, WorkerCrashed, trio.TooSlowError,
                ValueError) as exc:
            await self.kill()
            raise WorkerCrashed(f"HE worker {self.index} lost during {request.get('op')}: {exc!r}") from None
        except BaseException:  # cancelled mid-request: its answer would answer the next one
            with trio.CancelScope(shield=True):
                await self.kill()
            raise
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

    async def kill(self) -> None:
        process, self.process = self.process, None
        self.span = None
        if process is not None:
            with trio.move_on_after(5):
                process.kill()
                await process.wait()


class HEWorker:
    """The node's handle on its worker processes: one request at a time, each
    process restarted (and reloaded, with the key sets it held) after a crash."""

    def __init__(self, model_dir, *, params: str, preencode: bool = True, workers: int = 1,
                 budget_bytes: Callable[[tuple[int, int]], int | None] = lambda span: None,
                 noise: float = 0.0) -> None:
        self.model_dir, self.params, self.preencode = str(model_dir), params, preencode
        self.noise = noise
        self.budget_bytes = budget_bytes  # what the node's memory budget leaves for a span's encoded weights
        self.processes = [_Process(i) for i in range(max(1, min(workers, MAX_WORKERS)))]
        self.restarts = 0
        self._lock = trio.Lock()
        self._keys: collections.OrderedDict[str, bytes] = collections.OrderedDict()

    @property
    def workers(self) -> int:
        return len(self.processes)

    @property
    def span(self) -> tuple[int, int] | None:
        return self.processes[0].span

    @property
    def loaded(self) -> dict:
        """What the workers hold, all together."""
        parts = [p.loaded for p in self.processes if p.loaded]
        if not parts:
            return {}
        return {"plaintexts": sum(p["plaintexts"] for p in parts), "bytes": sum(p["bytes"] for p in parts),
                "seconds": max(p["seconds"] for p in parts), "preencoded": all(p["preencoded"] for p in parts),
                "preencode_bytes": parts[0]["preencode_bytes"], "workers": self.workers}

    async def _each(self, call: Callable[[_Process], object]) -> list:
        """`call` on every process at once; their results in order. A crash of any
        is counted and raised once the others are done, then a refusal (HEError):
        one error, never a group, for the server to answer."""
        results: list = [None] * self.workers
        crashed: list[WorkerCrashed] = []
        refused: list[HEError] = []  # a worker's answer to a bad request: the node's to give

        async def one(process: _Process) -> None:
            try:
                results[process.index] = await call(process)
            except WorkerCrashed as exc:
                crashed.append(exc)
            except HEError as exc:
                refused.append(exc)
            except Exception as exc:  # a worker that could not start, or a reply not as agreed
                await process.kill()
                crashed.append(WorkerCrashed(f"HE worker {process.index}: {exc!r}"))

        async with trio.open_nursery() as nursery:
            for process in self.processes:
                nursery.start_soon(one, process)
        if crashed:
            self.restarts += len(crashed)
            raise crashed[0]
        if refused:
            raise refused[0]
        return results

    async def _ensure(self, span: tuple[int, int]) -> None:
        if all(p.span == span and p.process is not None for p in self.processes):
            return
        budget = self.budget_bytes(span)

        async def load(process: _Process) -> None:
            if process.span == span and process.process is not None:
                return
            process.span = None  # until this load succeeds: a failed one may leave it half loaded
            process.loaded = await process.call(
                {"op": "load", "model_dir": self.model_dir, "start": span[0], "end": span[1], "params": self.params,
                 "preencode": self.preencode, "budget_bytes": budget, "noise": self.noise,
                 "share": [process.index, self.workers]}, timeout_s=600)
            process.span = span
            for digest, data in list(self._keys.items()):  # what a crashed worker held
                await process.call({"op": "keys", "digest": digest, "data": data}, timeout_s=60)

        await self._each(load)
        loaded = self.loaded
        log.info("HE workers (%d) hold blocks %d:%d %s: %d plaintexts, %.0f MB, in %.1fs", self.workers, span[0],
                 span[1], "pre-encoded" if loaded["preencoded"] else
                 f"to encode per request (pre-encoding needs {loaded['preencode_bytes'] / 1e6:.0f} MB, "
                 f"over the memory budget)", loaded["plaintexts"], loaded["bytes"] / 1e6, loaded["seconds"])

    async def load(self, span: tuple[int, int]) -> dict:
        async with self._lock:
            await self._ensure(span)
            return self.loaded

    async def add_keys(self, span: tuple[int, int], digest: str, data: bytes, keep: set[str] = frozenset()) -> None:
        """Install a key set; past MAX_KEY_SETS the least recently used ones not in
        `keep` (the open sessions') go."""
        async with self._lock:
            await self._ensure(span)
            await self._each(lambda p: p.call({"op": "keys", "digest": digest, "data": data}, timeout_s=60))
            self._keys[digest] = data
            spare = [d for d in self._keys if d not in keep and d != digest]  # least recently used first
            for old in spare[:max(0, len(self._keys) - MAX_KEY_SETS)]:
                await self._drop(old)

    def has_keys(self, digest: str) -> bool:
        return digest in self._keys

    async def forget_keys(self, digest: str) -> None:
        """Drop a key set (its owner sent a newer one)."""
        async with self._lock:
            await self._drop(digest)

    async def _drop(self, digest: str) -> None:
        self._keys.pop(digest, None)

        async def drop(process: _Process):
            if process.process is not None:
                await process.call({"op": "drop", "digest": digest}, timeout_s=30)

        await self._each(drop)

    async def project(self, span: tuple[int, int], digest: str, layer: int, group: str, tokens: int,
                      cts: list[bytes]) -> tuple[list[list[bytes]], float]:
        """Per group of the plan, its output ciphertexts in order; and the seconds
        the slowest worker computed."""
        async with self._lock:
            await self._ensure(span)
            if digest not in self._keys:
                raise HEError("unknown keys: send them first")
            self._keys.move_to_end(digest)
            request = {"op": "project", "digest": digest, "layer": layer, "group": group, "tokens": tokens,
                       "cts": cts}
            timeout = 120 + 10 * len(cts)
            replies = await self._each(lambda p: p.call(request, timeout_s=timeout))
            return (await self._join([r["parts"] for r in replies], replies[0]["outputs"]),
                    max(r["seconds"] for r in replies))

    async def _join(self, parts: list[list[list]], outputs: int) -> list[list[bytes]]:
        """Each group's `outputs` ciphertexts from every worker's parts: worker 0 adds
        an output's parts where more than one worker computed some of it, in calls
        of at most half a worker frame each."""
        groups = len(parts[0])
        by_output: list[dict[int, list[bytes]]] = [collections.defaultdict(list) for _ in range(groups)]
        for worker_parts in parts:
            for g, group in enumerate(worker_parts):
                for o, data in group:
                    by_output[g][o].append(data)
        sums = [(g, o) for g in range(groups) for o, datas in by_output[g].items() if len(datas) > 1]
        for batch in _batches(sums, lambda key: sum(len(d) for d in by_output[key[0]][key[1]]), MAX_WORKER_FRAME // 2):
            added = await self.processes[0].call({"op": "add", "parts": [by_output[g][o] for g, o in batch]},
                                                 timeout_s=60)
            for (g, o), data in zip(batch, added["cts"], strict=True):
                by_output[g][o] = [data]
        if any(sorted(found) != list(range(outputs)) for found in by_output):
            raise HEError(f"a product output has no nonzero weight (the plan makes {outputs})")
        return [[found[o][0] for o in range(outputs)] for found in by_output]

    @property
    def held_bytes(self) -> int:
        """Memory the workers hold for this node: encoded weights and key sets."""
        return int(self.loaded.get("bytes", 0)) + sum(len(k) for k in self._keys.values()) * 2 * self.workers

    async def aclose(self) -> None:
        for process in self.processes:
            await process.kill()


def _batches(items: list, size_of: Callable[[object], int], most: int) -> list[list]:
    """`items` in order, in batches whose sizes add up to at most `most` (an item
    larger than that alone)."""
    out: list[list] = []
    total = 0
    for item in items:
        size = size_of(item)
        if not out or total + size > most:
            out.append([])
            total = 0
        out[-1].append(item)
        total += size
    return out
