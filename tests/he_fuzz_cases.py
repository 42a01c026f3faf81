"""Mutated ciphertexts and Galois keys through he/ckks.py's loaders, in a process of
its own (tests/unit/test_he_fuzz.py runs it): SEAL is C++, and a forged object that
crashes it must fail that test with the case named, not take pytest down.

    python tests/he_fuzz_cases.py --seed 0 --cases 1500

Before each case its description goes to stderr (flushed), so a crash leaves the
case that caused it as the last line. Each case must raise HEError or return an
object that passes SEAL's validity check and can be computed on; the outcome counts,
per target and mutation, and anything else that happened are printed as JSON on
stdout. Deterministic for a seed.

Besides SEAL's own compressed (zstd) serialisations, the cases mutate uncompressed
ones rebuilt field by field (SEAL's format: a 16-byte header, then Ciphertext:
parms_id, is_ntt_form, size, poly_modulus_degree, coeff_modulus_size, scale,
correction_factor, a DynArray with its own header and count; GaloisKeys: parms_id,
a count of key slots, per slot a count and that many PublicKey ciphertexts), so a
mutation can lie in one field and reach SEAL's checks behind the decompressor.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import random
import resource
import struct
import sys
import time

import numpy as np

from compushare.he.ckks import SEAL_HEADER, SEAL_MAGIC, HEError, SecretContext, galois_element

STEP = 1
STEPS = frozenset({STEP})
CT_FIELDS = struct.Struct("<4QBQQQdQ")  # parms_id, is_ntt_form, size, poly degree, coeff moduli, scale, correction
DYN_COUNT = struct.Struct("<Q")


def seed_seal(seed: int) -> None:
    """Every SEAL context made from here on draws its randomness (secret key, errors,
    the seeds of fresh ciphertexts) from a PRNG seeded with `seed`: the same valid
    objects, byte for byte, every run, so the same cases. Only for this process; a
    context built this way is not secure (each PRNG it creates starts from the seed)."""
    import tenseal.sealapi as seal  # noqa: PLC0415

    original = seal.EncryptionParameters
    words = [(seed * 0x9E3779B97F4A7C15 + i) % 2**64 for i in range(8)]

    def parameters(scheme):
        parms = original(scheme)
        parms.set_random_generator(seal.Blake2xbPRNGFactory(words))
        return parms

    seal.EncryptionParameters = parameters


class Material:
    """Valid objects to mutate, and what their fields look like."""

    def __init__(self) -> None:
        self.secret = s = SecretContext()
        self.provider = s  # the loaders are Context's; a SecretContext is one
        self.seal = s.seal
        rng = np.random.default_rng(0)
        self.x = rng.normal(0, 1, s.slots)
        self.ct = s.encrypt(self.x)  # seeded, zstd
        self.minor = SEAL_HEADER.unpack_from(self.ct)[3]
        loaded = s.ciphertext_from(self.ct)
        self.ct_raw = self.raw_ciphertext(loaded)  # full, uncompressed
        out = s.seal.Ciphertext()
        s.evaluator.multiply_plain(loaded, s.encode(np.ones(s.slots), s.weight_scale), out)
        s.evaluator.rescale_to_next_inplace(out)
        self.out = s.dump(out)  # a product: one prime, zstd
        self.keys = s.galois_keys(STEPS)
        self.good_keys = s.galois_keys_from(self.keys, STEPS)
        self.keys_raw = self.raw_keys(self.good_keys)
        self.good_ct = loaded
        self.other_level = list(out.parms_id())
        moduli = s.context.first_context_data().parms().coeff_modulus()
        self.moduli = [m.value() for m in moduli]

    def header(self, compression: int, size: int) -> bytes:
        return SEAL_HEADER.pack(SEAL_MAGIC, SEAL_HEADER.size, 4, self.minor, compression, 0, size)

    def raw_ciphertext(self, ct, **fields) -> bytes:
        d = ct.dyn_array()
        values = np.array([d.at(i) for i in range(d.size())], dtype=np.uint64)
        members = CT_FIELDS.pack(*ct.parms_id(), int(ct.is_ntt_form()), ct.size(), ct.poly_modulus_degree(),
                                 ct.coeff_modulus_size(), ct.scale, 1)
        dyn = DYN_COUNT.pack(len(values)) + values.tobytes()
        body = members + self.header(0, SEAL_HEADER.size + len(dyn)) + dyn
        return self.header(0, SEAL_HEADER.size + len(body)) + body

    def raw_keys(self, keys) -> bytes:
        element = galois_element(STEP, self.secret.params.poly_degree)
        index = keys.get_index(element)
        pks = keys.key(element)
        body = struct.pack("<4QQ", *keys.parms_id(), index + 1) + struct.pack("<Q", 0) * index
        body += struct.pack("<Q", len(pks)) + b"".join(self.raw_ciphertext(pk.data()) for pk in pks)
        self.keys_first_ct = SEAL_HEADER.size + 40 + 8 * (index + 1)  # where the first PublicKey starts
        return self.header(0, SEAL_HEADER.size + len(body)) + body


def fix_size(data: bytes) -> bytes:
    """The header's size field made to match (so SEAL, not check_header, sees the lie)."""
    if len(data) < SEAL_HEADER.size:
        return data
    return data[:8] + struct.pack("<Q", len(data)) + data[16:]


def zstd_rle(blocks: int, byte: int = 0, prefix: bytes = b"") -> bytes:
    """A zstd frame: `prefix` in raw blocks, then `blocks` RLE blocks of 128 KiB each
    (4 bytes on the wire: a decompression bomb of ratio 32768)."""
    out = bytearray(bytes.fromhex("28b52ffd") + bytes([0x00, 0x38]))  # no content size, window 2^17
    chunks = [prefix[i:i + (1 << 17)] for i in range(0, len(prefix), 1 << 17)]
    total = len(chunks) + blocks
    n = 0
    for chunk in chunks:
        n += 1
        out += ((len(chunk) << 3) | (n == total)).to_bytes(3, "little") + chunk
    for _ in range(blocks):
        n += 1
        out += ((131072 << 3) | (1 << 1) | (n == total)).to_bytes(3, "little") + bytes([byte])
    return bytes(out)


# ------------------------------------------------------------------ mutations
# Each takes (material, rng, data, base) and returns (description, bytes).


def bitflip_any(m, rng, data, base):
    data = bytearray(data)
    spots = [rng.randrange(len(data) * 8) for _ in range(rng.randint(1, 8))]
    for bit in spots:
        data[bit // 8] ^= 1 << (bit % 8)
    return f"bits {spots}", bytes(data)


def bitflip_body(m, rng, data, base):
    data = bytearray(data)
    spots = [rng.randrange(SEAL_HEADER.size * 8, len(data) * 8) for _ in range(rng.randint(1, 16))]
    for bit in spots:
        data[bit // 8] ^= 1 << (bit % 8)
    return f"body bits {spots}", bytes(data)


def bytes_body(m, rng, data, base):
    data = bytearray(data)
    start = rng.randrange(SEAL_HEADER.size, len(data))
    run = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))[:len(data) - start]  # the length kept
    data[start:start + len(run)] = run
    return f"body bytes at {start} len {len(run)}", bytes(data)


def truncate(m, rng, data, base):
    at = rng.choice([0, 1, 8, 15, 16, 17, 32, 64, rng.randrange(len(data)), len(data) - 1, len(data) // 2])
    fixed = rng.random() < 0.6
    out = data[:at]
    return f"truncate at {at} fixed={fixed}", fix_size(out) if fixed else out


def extend(m, rng, data, base):
    extra = rng.choice([1, 8, 64, 1000, 100_000])
    fill = rng.choice(["zero", "random", "copy"])
    tail = {"zero": bytes(extra), "random": rng.randbytes(extra),
            "copy": (data * (extra // len(data) + 1))[:extra]}[fill]
    fixed = rng.random() < 0.6
    out = data + tail
    return f"extend {extra} {fill} fixed={fixed}", fix_size(out) if fixed else out


HEADER_FIELDS = {  # field: (offset, format, candidate values)
    "magic": (0, "<H", [0, 0xA15F, 0x5EA1, 0xFFFF]),
    "header_size": (2, "B", [0, 15, 17, 255]),
    "major": (3, "B", [0, 3, 5, 255]),
    "minor": (4, "B", [0, 1, 2, 4, 255]),
    "compression": (5, "B", [0, 1, 2, 3, 255]),
    "reserved": (6, "<H", [1, 0xFFFF]),
    "size": (8, "<Q", [0, 15, 16, 2**32, 2**63, 2**64 - 1]),
}
MUST_REJECT_FIELDS = {"magic", "header_size", "major", "minor", "size"}


def header_field(m, rng, data, base):
    name = rng.choice(sorted(HEADER_FIELDS))
    offset, fmt, values = HEADER_FIELDS[name]
    value = rng.choice(values + ["len-1", "len+1"] if name == "size" else values)
    if value == "len-1":
        value = len(data) - 1
    elif value == "len+1":
        value = len(data) + 1
    data = bytearray(data)
    struct.pack_into(fmt, data, offset, value)
    return f"header {name}={value}", bytes(data)


def random_body(m, rng, data, base):
    compression = rng.choice([0, 0, 1, 2, 2])
    length = rng.choice([0, 1, 8, 64, 512, 4096, 65536, rng.randrange(len(data))])
    kind = rng.choice(["random", "zero", "ones"])
    body = {"random": rng.randbytes(length), "zero": bytes(length), "ones": b"\xff" * length}[kind]
    return f"random body {kind} len {length} compression {compression}", m.header(compression, 16 + length) + body


def splice(m, rng, data, base):
    """A valid header on another object's (or a mutated) body, size fixed."""
    donor = rng.choice([m.ct, m.ct_raw, m.out, m.keys, m.keys_raw])
    compression = rng.choice([0, 1, 2])
    body = donor[16:]
    if rng.random() < 0.5:
        body = body[:rng.randrange(1, len(body) + 1)]
    return f"splice body of {len(donor)}-byte object under compression {compression}", \
        fix_size(m.header(compression, 0) + body)


def bomb(m, rng, data, base):
    """zstd frames that inflate far beyond the bytes sent."""
    limit = len(data) if base not in ("keys", "keys_raw") else len(m.keys_raw)
    kind = rng.choice(["rle", "prefix", "prefix_zero"])
    if kind == "rle":
        frame = zstd_rle(min(rng.choice([10, 1000, 20_000]), (limit - 32) // 4), byte=rng.randrange(256))
    else:
        prefix = (m.ct_raw if base in ("ct", "ct_raw") else m.keys_raw)[16:]
        if kind == "prefix_zero":
            prefix = prefix[:rng.randrange(16, 200)]  # the fields, then zeros for the data
        blocks = max(1, (limit - len(prefix) - 64) // 4) if len(prefix) < limit else 1
        frame = zstd_rle(min(blocks, 20_000), prefix=prefix)
    return f"zstd bomb {kind} ({len(frame)} bytes)", fix_size(m.header(2, 0) + frame)


def transparent(m, rng, data, base):
    """An uncompressed ciphertext whose second polynomial (or everything) is zero: no
    encryption at all (SEAL refuses to compute on it)."""
    data = bytearray(data)
    start = SEAL_HEADER.size if base == "ct_raw" else m.keys_first_ct + SEAL_HEADER.size
    coefficients = start + 73 + 24
    count = struct.unpack_from("<Q", data, start + 73 + 16)[0]
    which = rng.choice(["c1", "all"])
    first = count // 2 if which == "c1" else 0
    data[coefficients + 8 * first:coefficients + 8 * count] = bytes(8 * (count - first))
    return f"zero {which}", bytes(data)


# Fields of an uncompressed ciphertext, at their offsets after the 16-byte header.
RAW_CT_FIELDS = {
    "parms_id": (0, "<4Q"),
    "is_ntt_form": (32, "B"),
    "size": (33, "<Q"),
    "poly_degree": (41, "<Q"),
    "coeff_moduli": (49, "<Q"),
    "scale": (57, "<d"),
    "correction": (65, "<Q"),
    "dyn_header_size": (73 + 8, "<Q"),
    "dyn_compression": (73 + 5, "B"),
    "dyn_count": (73 + 16, "<Q"),
}
MUST_REJECT_RAW = {"parms_id", "size", "poly_degree", "coeff_moduli", "scale", "coefficient_ge_q", "dyn_count",
                   "dyn_header_size", "is_ntt_form", "keys_dim1", "keys_dim2"}


def raw_values(m, name, base):
    huge = [2**32, 2**40, 2**63, 2**64 - 1]
    if name == "parms_id":
        return [(0, 0, 0, 0), (1, 2, 3, 4), tuple(m.other_level)] if base == "ct_raw" else [(0, 0, 0, 0),
                                                                                                (5, 6, 7, 8)]
    if name == "is_ntt_form":
        return [0]
    if name == "scale":
        return [0.0, -1.0, float("nan"), float("inf"), 2.0**35, 2.0**36 + 1, 2.0**200, 5e-324]
    if name == "size":
        return [0, 1, 3, 16] + huge
    if name in ("poly_degree",):
        return [0, 1, 4096, 16384] + huge
    if name == "coeff_moduli":  # never the true count (2 for an input, 3 for a key)
        return [0, 1, 4] + huge + ([3] if base == "ct_raw" else [2])
    if name == "correction":
        return [0, 2] + huge
    if name == "dyn_compression":
        return [1, 2, 3]
    return [0, 1, 100] + huge


def raw_field(m, rng, data, base):
    """One field of an uncompressed ciphertext (for keys: of its first PublicKey) set
    to a lie; the sizes around it left alone."""
    start = SEAL_HEADER.size if base == "ct_raw" else m.keys_first_ct + SEAL_HEADER.size
    data = bytearray(data)
    choice = rng.random()
    if base == "keys_raw" and choice < 0.3:
        name = rng.choice(["keys_dim1", "keys_dim2"])
        offset = SEAL_HEADER.size + 32 if name == "keys_dim1" else m.keys_first_ct - 8
        value = rng.choice([0, 3, 4096, 8192, 8193, 2**26, 2**40, 2**64 - 1] if name == "keys_dim1"
                           else [0, 1, 3, 4, 2**40, 2**64 - 1])
        if value in (0,) or (name == "keys_dim1" and value == 3):
            name += "_soft"  # fewer or more slots that are empty: may fail for a missing key or the stream's end
        struct.pack_into("<Q", data, offset, value)
        return f"raw {name}={value}", bytes(data)
    if choice < 0.45:
        # A coefficient at or above its modulus.
        coefficients = start + 73 + 24
        count = struct.unpack_from("<Q", data, start + 73 + 16)[0]
        i = rng.randrange(count)
        prime = m.moduli[(i // m.secret.params.poly_degree) % 2] if base == "ct_raw" else 2**60
        value = rng.choice([prime, prime + 1, 2**64 - 1]) if base == "ct_raw" else 2**64 - 1
        struct.pack_into("<Q", data, coefficients + 8 * i, value)
        return f"raw coefficient_ge_q [{i}]={value}", bytes(data)
    if choice < 0.55:
        # A coefficient changed but kept small: a different, valid ciphertext.
        i = rng.randrange(1000)
        struct.pack_into("<Q", data, start + 73 + 24 + 8 * i, rng.randrange(1 << 20))
        return f"raw coefficient_small [{i}]", bytes(data)
    name = rng.choice(sorted(RAW_CT_FIELDS))
    offset, fmt = RAW_CT_FIELDS[name]
    value = rng.choice(raw_values(m, name, base))
    if fmt == "<4Q":
        struct.pack_into(fmt, data, start + offset, *value)
    else:
        struct.pack_into(fmt, data, start + offset, value)
    if name == "scale" and base == "keys_raw":
        name += "_key"  # SEAL does not read a key's scale
    if name == "correction":
        name += "_ckks"  # BGV's; CKKS ignores it
    return f"raw {name}={value}", bytes(data)


GENERIC = [bitflip_any, bitflip_body, bytes_body, truncate, extend, header_field, random_body, splice, bomb]


def confusion(m, rng, data, base):
    other = rng.choice([m.keys, m.keys_raw] if base in ("ct", "ct_raw", "out") else [m.ct, m.ct_raw, m.out])
    return f"type confusion ({len(other)}-byte object)", other


# ------------------------------------------------------------------ running


def must_reject(kind: str, description: str) -> bool:
    """Mutations no loader may accept: whatever else SEAL tolerates (trailing bytes
    after a compressed object, the reserved header field, a different but valid
    coefficient), these leave no valid object of the expected kind."""
    field = kind.split(":")[-1]
    if kind.startswith("header_field"):
        value = description.split("=")[1]
        return field in MUST_REJECT_FIELDS or (field == "compression" and int(value) > 2)
    if kind.startswith("raw_field"):
        return field in MUST_REJECT_RAW
    if kind in ("truncate", "extend"):
        return "fixed=False" in description
    if kind == "bomb":
        return "bomb rle" in description  # a valid prefix and junk after it may load (SEAL stops reading)
    if kind == "transparent":
        return "keys" not in description
    return kind in ("confusion", "random_body")



def load(m, base, data):
    p = m.provider
    if base in ("ct", "ct_raw"):
        return p.ciphertext_from(data)
    if base == "out":
        return p.ciphertext_from(data, output=True)
    return p.galois_keys_from(data, STEPS)


def use(m, base, obj) -> str | None:
    """Checks an accepted object independently and computes with it; a reason if it
    is not valid."""
    s, seal = m.secret, m.seal
    if not seal.is_valid_for(obj, s.context):
        return "not valid for the context"
    if base in ("keys", "keys_raw"):
        if not obj.has_key(galois_element(STEP, s.params.poly_degree)):
            return "no key for the step"
        out = seal.Ciphertext()
        s.evaluator.rotate_vector(m.good_ct, STEP, obj, out)
        plain = seal.Plaintext()
        s._decryptor.decrypt(out, plain)
        s.encoder.decode_double(plain)
        return None
    level = s.output_level if base == "out" else s.input_level
    if obj.size() != 2 or obj.parms_id() != level or not obj.is_ntt_form():
        return "wrong size, level or form"
    ct = obj
    if base != "out":
        ct = seal.Ciphertext()
        s.evaluator.rotate_vector(obj, STEP, m.good_keys, ct)
        s.evaluator.multiply_plain_inplace(ct, s.encode(np.ones(s.slots), s.weight_scale))
        s.evaluator.rescale_to_next_inplace(ct)
    plain = seal.Plaintext()
    s._decryptor.decrypt(ct, plain)
    s.encoder.decode_double(plain)
    return None


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux keeps the
    high-water mark of the mm an exec replaced, so a child of a big pytest process
    would report its parent's size."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=1500)
    args = parser.parse_args()
    began = time.perf_counter()
    seed_seal(args.seed)
    m = Material()
    rng = random.Random(args.seed)
    bases = {"ct": m.ct, "ct_raw": m.ct_raw, "out": m.out, "keys": m.keys, "keys_raw": m.keys_raw}
    weights = {"ct": 5, "ct_raw": 5, "out": 2, "keys": 3, "keys_raw": 3}
    names = [b for b in bases for _ in range(weights[b])]
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_mutation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unexpected, invalid, accepted_must_reject = [], [], []
    # The unmutated objects first: each must load.
    for base, data in bases.items():
        if use(m, base, load(m, base, data)) is not None:
            raise SystemExit(f"valid {base} failed its own check")
    for case in range(args.cases):
        base = rng.choice(names)
        pool = GENERIC + [confusion] + ([raw_field] * 4 + [transparent] if base.endswith("_raw") else [])
        mutation = rng.choice(pool)
        description, data = mutation(m, rng, bases[base], base)
        label = f"case {case} {base} {mutation.__name__}: {description}"
        if mutation is transparent:
            description += f" ({base})"
        print(label, file=sys.stderr, flush=True)
        kind = mutation.__name__
        if kind == "header_field":
            kind += ":" + description.split()[1].split("=")[0]
        elif kind == "raw_field":
            kind += ":" + description.split()[1].split("=")[0].split("[")[0]
        try:
            obj = load(m, base, data)
        except HEError:
            outcome = "rejected"
        except Exception as exc:  # noqa: BLE001  (what the test looks for)
            outcome = "unexpected"
            unexpected.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            outcome = "accepted"
            try:
                reason = use(m, base, obj)
            except Exception as exc:  # noqa: BLE001
                reason = f"computing on it raised {type(exc).__name__}: {str(exc)[:200]}"
            if reason is not None:
                invalid.append(f"{label}: {reason}")
            if must_reject(kind, description):
                accepted_must_reject.append(label)
        outcomes[base][outcome] += 1
        by_mutation[kind][outcome] += 1
    print(json.dumps({
        "cases": args.cases,
        "seconds": round(time.perf_counter() - began, 2),
        "max_rss_mb": peak_rss_mb(),
        "material": hashlib.sha256(b"".join([m.ct, m.ct_raw, m.out, m.keys, m.keys_raw])).hexdigest(),
        "outcomes": {k: dict(v) for k, v in sorted(outcomes.items())},
        "by_mutation": {k: dict(v) for k, v in sorted(by_mutation.items())},
        "unexpected": unexpected,
        "invalid": invalid,
        "accepted_must_reject": accepted_must_reject,
    }))


if __name__ == "__main__":
    main()
