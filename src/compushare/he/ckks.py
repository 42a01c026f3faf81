"""CKKS through TenSEAL's binding of Microsoft SEAL (`tenseal.sealapi`).

TenSEAL's own vectors have no rotation (its issues #122, #306, #515), so private
mode uses the SEAL objects TenSEAL ships: CKKSEncoder, Encryptor (symmetric, seeded:
half-size ciphertexts), Evaluator.rotate_vector / multiply_plain, GaloisKeys for
exactly the rotations the plans need.

Parameters come from a whitelist (`PARAMETER_SETS`): a peer names a set, it never
sends parameters. The only set today is N = 8192 with moduli [60, 40 | 60]: two data
primes and a 60-bit special prime for key switching. 160 bits of modulus is under
the 218 that the HE standard allows for 128-bit security at N = 8192, and SEAL
refuses to build it otherwise (sec_level TC128). Inputs and weights are encoded
at 2^40; a provider rescales each inner sum of a product by the 40-bit prime
(scale 2^40, one prime: its giant-step rotation costs half, and half the bytes go
back), so a product may reach about +-2^19 (SmolLM2's largest seen: 5.8e3) before
it wraps. Inputs at 2^36 gave 10-30x the error (the rotations' key-switching noise
is absolute, after the early rescale) and flipped near-tied greedy tokens of the
tiny test model. One data prime less ([60 | 60], scales 2^30 x 2^24) halves the
time but gave 3e-5 and bounds products at +-32, too tight for real activations.

Serialised objects from peers pass `check_header` (SEAL's header, a known size)
before SEAL parses them, and are then checked against the context by SEAL's own
`load` (is_valid_for: every coefficient below its modulus). The provider does both
in its HE worker process (pipeline/server/private_worker.py), where a crash
cannot take the node down.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
import struct
import tempfile
import threading

import numpy as np

from ..errors import CompushareError


class HEError(CompushareError):
    """A ciphertext, key or context that is malformed, forged or not for this context."""


@dataclasses.dataclass(frozen=True)
class ParameterSet:
    name: str
    poly_degree: int
    coeff_bits: tuple[int, ...]
    input_scale_bits: int
    weight_scale_bits: int

    @property
    def slots(self) -> int:
        return self.poly_degree // 2

    def max_keys_bytes(self, steps: int) -> int:
        """An upper bound on serialised Galois keys for `steps` rotations (one key
        switching key each: per data prime, 2 polynomials over every prime)."""
        return steps * (2 * (len(self.coeff_bits) - 1) * len(self.coeff_bits) * self.poly_degree * 8 + 1024) + 4096


PARAMETER_SETS = {
    "ckks-8192-60-40-60": ParameterSet("ckks-8192-60-40-60", 8192, (60, 40, 60), 40, 40),
}
DEFAULT_PARAMETERS = "ckks-8192-60-40-60"

SEAL_MAGIC = 0xA15E
SEAL_HEADER = struct.Struct("<HBBBBHQ")  # magic, header size, major, minor, compression, reserved, size


def parameter_set(name: str) -> ParameterSet:
    try:
        return PARAMETER_SETS[name]
    except (KeyError, TypeError):
        raise HEError(f"unknown CKKS parameter set {name!r}; known: {sorted(PARAMETER_SETS)}") from None


def galois_element(step: int, poly_degree: int) -> int:
    """SEAL's Galois element for a left rotation by `step` slots."""
    return pow(3, step % (poly_degree // 2), 2 * poly_degree)


def check_header(data: bytes, *, max_size: int, what: str) -> None:
    """SEAL's serialisation header, checked before SEAL reads a byte of `data`."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < SEAL_HEADER.size:
        raise HEError(f"{what}: not a SEAL object ({len(data) if isinstance(data, bytes) else type(data).__name__})")
    magic, header_size, major, minor, compression, _reserved, size = SEAL_HEADER.unpack_from(data)
    if magic != SEAL_MAGIC or header_size != SEAL_HEADER.size or major != 4:
        raise HEError(f"{what}: not a SEAL 4 object")
    if compression not in (0, 1, 2):
        raise HEError(f"{what}: unknown compression {compression}")
    if size != len(data):
        raise HEError(f"{what}: header says {size} bytes, {len(data)} came")
    if size > max_size:
        raise HEError(f"{what}: {size} bytes, at most {max_size} accepted")


class _Scratch:
    """SEAL's binding saves and loads through file paths only: a per-process scratch
    directory in memory (/dev/shm where there is one)."""

    def __init__(self) -> None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.dir = tempfile.mkdtemp(prefix="compushare-he-", dir=root)
        self._names = itertools.count()
        self._lock = threading.Lock()

    def path(self) -> str:
        with self._lock:
            return os.path.join(self.dir, f"{os.getpid()}-{next(self._names)}")

    def dump(self, obj) -> bytes:
        path = self.path()
        try:
            obj.save(path)
            with open(path, "rb") as f:
                return f.read()
        finally:
            _unlink(path)

    def load(self, obj, context, data: bytes) -> None:
        path = self.path()
        try:
            with open(path, "wb") as f:
                f.write(data)
            if context is None:
                obj.load(path)
            else:
                obj.load(context, path)
        finally:
            _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@functools.lru_cache(maxsize=1)
def scratch() -> _Scratch:
    return _Scratch()


def _sealapi():
    import tenseal.sealapi as seal  # noqa: PLC0415  (seconds of import; only private mode needs it)

    return seal


class Context:
    """The public part: SEAL context, encoder and evaluator of one parameter set."""

    def __init__(self, params: ParameterSet | str = DEFAULT_PARAMETERS) -> None:
        seal = _sealapi()
        self.params = parameter_set(params) if isinstance(params, str) else params
        p = self.params
        parms = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
        parms.set_poly_modulus_degree(p.poly_degree)
        parms.set_coeff_modulus(seal.CoeffModulus.Create(p.poly_degree, list(p.coeff_bits)))
        self.seal = seal
        self.context = seal.SEALContext(parms, True, seal.SEC_LEVEL_TYPE.TC128)
        if not self.context.parameters_set():
            raise HEError(f"SEAL refuses {p.name}: {self.context.parameters_error_message()}")
        self.encoder = seal.CKKSEncoder(self.context)
        self.evaluator = seal.Evaluator(self.context)
        self.slots = self.encoder.slot_count()
        self.input_scale = 2.0 ** p.input_scale_bits
        self.weight_scale = 2.0 ** p.weight_scale_bits
        top = self.context.first_context_data()
        if top.next_context_data() is None:
            raise HEError(f"{p.name}: a product is rescaled once, so two data primes at least are needed")
        self.input_level = top.parms_id()
        self.output_level = top.next_context_data().parms_id()
        # A product is rescaled by the last data prime: its scale is then this, exactly.
        self.output_scale = self.input_scale * self.weight_scale / top.parms().coeff_modulus()[-1].value()
        # Upper bounds for serialised objects (a fresh full ciphertext is 2 polys of
        # one prime; a Galois key is one key-switching key of 2 x 2 polys).
        poly_bytes = p.poly_degree * 8
        self.max_ciphertext_bytes = 2 * len(p.coeff_bits) * poly_bytes + 1024

    def encode(self, values: np.ndarray, scale: float):
        """Real or complex slot values (plan.py packs two columns a complex slot)."""
        plain = self.seal.Plaintext()
        values = np.asarray(values)
        kind = np.complex128 if np.iscomplexobj(values) else np.float64
        self.encoder.encode(values.astype(kind).tolist(), scale, plain)
        return plain

    def ciphertext_from(self, data: bytes, *, output: bool = False):
        """A peer's ciphertext (an input, or with `output` a product): header, SEAL's
        validity check, then its size, level and scale."""
        level, scale = (self.output_level, self.output_scale) if output else (self.input_level, self.input_scale)
        ct = self._load(self.seal.Ciphertext(), data, max_size=self.max_ciphertext_bytes, what="ciphertext")
        if ct.size() != 2 or ct.parms_id() != level or not ct.is_ntt_form():
            raise HEError("ciphertext of the wrong size, level or form")
        if ct.is_transparent():  # c1 all zero: no encryption, and SEAL raises on any product of it
            raise HEError("transparent ciphertext")
        if ct.scale != scale:
            raise HEError(f"ciphertext at scale 2^{np.log2(ct.scale):.1f}, expected 2^{np.log2(scale):.1f}")
        return ct

    def galois_keys_from(self, data: bytes, steps: frozenset[int]):
        """A peer's Galois keys, which must hold a key for every step in `steps`."""
        keys = self._load(self.seal.GaloisKeys(), data, max_size=self.params.max_keys_bytes(max(1, len(steps))),
                          what="Galois keys")
        missing = [s for s in sorted(steps) if not keys.has_key(galois_element(s, self.params.poly_degree))]
        if missing:
            raise HEError(f"Galois keys lack rotations {missing[:8]}{'...' if len(missing) > 8 else ''}")
        return keys

    def _load(self, obj, data: bytes, *, max_size: int, what: str):
        """`obj` loaded from a peer's bytes: SEAL's header checked first, then SEAL's
        own parse and validity check against this context."""
        check_header(data, max_size=max_size, what=what)
        try:
            scratch().load(obj, self.context, bytes(data))
        except (RuntimeError, ValueError) as exc:
            raise HEError(f"{what} rejected: {exc}") from None
        if not self.seal.is_valid_for(obj, self.context):
            raise HEError(f"{what} not valid for this context")
        return obj

    def dump(self, obj) -> bytes:
        return scratch().dump(obj)


class SecretContext(Context):
    """The consumer's side: it alone holds the secret key. Encrypts symmetrically
    (seeded: a fresh ciphertext travels at half size) and decrypts."""

    def __init__(self, params: ParameterSet | str = DEFAULT_PARAMETERS) -> None:
        super().__init__(params)
        seal = self.seal
        self._keygen = seal.KeyGenerator(self.context)
        self._secret = self._keygen.secret_key()
        self._encryptor = seal.Encryptor(self.context, self._secret)
        self._decryptor = seal.Decryptor(self.context, self._secret)

    def galois_keys(self, steps) -> bytes:
        """Serialised (seeded) Galois keys for exactly these rotation steps."""
        elements = sorted({galois_element(s, self.params.poly_degree) for s in steps})
        return scratch().dump(self._keygen.create_galois_keys(elements))

    def encrypt(self, slots: np.ndarray) -> bytes:
        if len(slots) != self.slots:
            raise ValueError(f"{len(slots)} values for {self.slots} slots")
        return scratch().dump(self._encryptor.encrypt_symmetric(self.encode(slots, self.input_scale)))

    def decrypt(self, data: bytes) -> np.ndarray:
        """A provider's product ciphertext: checked like any peer's, then decrypted."""
        ct = self.ciphertext_from(data, output=True)
        plain = self.seal.Plaintext()
        self._decryptor.decrypt(ct, plain)
        return np.asarray(self.encoder.decode_double(plain))


def keys_digest(data: bytes) -> str:
    """What a session's public key material is cached under."""
    return hashlib.sha256(data).hexdigest()
