"""The provider's HE worker: a child process that holds the span's encoded weights
and runs every encrypted product.

Why a process: TenSEAL's (SEAL's) deserialisers were not written for hostile
bytes. Every key and ciphertext a peer sends is parsed here, behind he/ckks.py's
checks; if one still crashes SEAL, the node loses this process (it restarts it and
answers the request with an error), not itself. It also keeps CKKS compute off the
node's event loop and out of its GIL.

The node talks to it over stdin/stdout: frames of a 4-byte big-endian length and a
msgpack map. Requests (one at a time):

    {"op": "load", "model_dir", "start", "end", "params", "preencode", "budget_bytes",
     "share": [i, n], "noise"}             -> {"plaintexts", "bytes", "seconds", "preencoded",
                                               "preencode_bytes"}
    {"op": "keys", "digest", "data"}       -> {"bytes"}
    {"op": "drop", "digest"}               -> {}
    {"op": "project", "digest", "layer", "group", "tokens", "cts"}
        -> {"parts": [[[output, bytes], ...] per group], "outputs", "seconds"}
    {"op": "add", "parts": [[bytes, ...], ...]} -> {"cts": [bytes, ...]}

A node runs n workers on one span (private_pool.py): worker i holds and computes
share i of every product's (output, giant step) pairs (he/matvec.py), and the
node has worker 0 add the parts.

A failure is {"error": message}.
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import sys
import time

import msgpack
import numpy as np

from ...he.ckks import Context, HEError, keys_digest
from ...he.groups import GROUPS, ShapeConfig, group_weight, layer_prefix, preencoded_bytes, required_steps
from ...he.matvec import EncodedMatrix, add
from ...he.plan import choose, plans

log = logging.getLogger(__name__)

LENGTH = struct.Struct(">I")
MAX_WORKER_FRAME = 64 << 20


class WorkerState:
    """What the worker process holds; `handle` answers one request. No I/O."""

    def __init__(self) -> None:
        self.context: Context | None = None
        self.span: tuple[int, int] | None = None
        self.weights: dict[tuple[int, str], np.ndarray] = {}  # (layer, group) -> its weight, when not pre-encoded
        self.encoded: dict[tuple[int, str, object], EncodedMatrix] = {}  # (layer, group, plan) -> this share's
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        self.share = (0, 1)
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
        if op == "add":
            return self._add(request)
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
        self.span = None  # until this load succeeds: one that fails part-way serves nothing
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
        index, workers = (int(v) for v in request.get("share", (0, 1)))
        if not 0 <= index < workers:
            raise HEError(f"share {index} of {workers}")
        self.share = (index, workers)
        need = preencoded_bytes(config, self.context.slots, p.poly_degree, len(p.coeff_bits) - 1) * (end - start)
        budget = request.get("budget_bytes")  # the node's, for all its workers' shares together
        self.preencode = bool(request.get("preencode", True)) and (budget is None or need <= budget)
        self.weights.clear()
        self.encoded.clear()
        self.shapes.clear()
        plaintexts = nbytes = 0
        for layer in range(start, end):
            for group in GROUPS:
                weight = group_weight(state, layer, group)
                self.weights[(layer, group)] = weight
                self.shapes[(layer, group)] = weight.shape
                if not self.preencode:
                    nbytes += weight.nbytes
                    continue
                for plan in plans(*weight.shape, self.context.slots):
                    encoded = EncodedMatrix(self.context, weight, plan, self.share)
                    plaintexts += encoded.plaintexts
                    nbytes += encoded.nbytes
                    self.encoded[(layer, group, plan)] = encoded
        if self.preencode:
            self.weights.clear()
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
        if digest not in self.keys:  # the node bounds how many (private_pool.MAX_KEY_SETS)
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
        tokens, cts = request["tokens"], request["cts"]
        plan = choose(*self.shapes[(layer, group)], self.context.slots, tokens)
        if len(cts) != plan.groups(tokens) * plan.chunks:
            raise HEError(f"{len(cts)} ciphertexts for {tokens} tokens: the plan takes "
                          f"{plan.groups(tokens) * plan.chunks}")
        matrix = self.encoded.get((layer, group, plan))
        if matrix is None:  # encoding on the fly: slower, far less memory
            matrix = EncodedMatrix(self.context, self.weights[(layer, group)], plan, self.share)
        inputs = [self.context.ciphertext_from(data) for data in cts]  # all checked before any work
        parts = []
        for start in range(0, len(inputs), plan.chunks):
            outs = matrix.apply(self.context, keys, inputs[start:start + plan.chunks])
            parts.append([[o, self.context.dump(self._lie(ct))] for o, ct in sorted(outs.items())])
        return {"parts": parts, "outputs": plan.outputs, "seconds": time.perf_counter() - began}

    def _add(self, request: dict) -> dict:
        """Each output's parts from the workers, summed (they are this node's own)."""
        if self.context is None:
            raise HEError("no span loaded")
        out = []
        for parts in request["parts"]:
            loaded = [self.context.ciphertext_from(data, output=True) for data in parts]
            out.append(self.context.dump(add(self.context, loaded)))
        return {"cts": out}


    def _lie(self, ct):
        """With fault injection on, add Gaussian noise of `noise` (absolute: a liar
        cannot see the values) to every slot of a product."""
        if self.noise > 0:
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


def main() -> None:
    # A worker must never write anything but frames to stdout.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serve_stdio()


if __name__ == "__main__":
    main()
