"""A Merkle tree over a ledger's receipts (RFC 6962 hashing). Pure, no I/O.

Leaves and inner nodes are hashed with different prefixes, so a leaf can never
pass for a subtree. A ledger record commits to its first `count` receipts by this
root; `proof`/`verify` let one receipt's inclusion be shown without the others.
"""

from __future__ import annotations

import hashlib


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two below n (n >= 2)."""
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def _root(hashes: list[bytes]) -> bytes:
    if len(hashes) == 1:
        return hashes[0]
    k = _split(len(hashes))
    return _node(_root(hashes[:k]), _root(hashes[k:]))


def merkle_root(leaves: list[bytes]) -> bytes:
    if not leaves:
        return hashlib.sha256(b"").digest()
    return _root([leaf_hash(leaf) for leaf in leaves])


def proof(leaves: list[bytes], index: int) -> list[bytes]:
    """The sibling hashes from leaf `index` up to the root."""
    if not 0 <= index < len(leaves):
        raise IndexError(index)
    hashes = [leaf_hash(leaf) for leaf in leaves]
    path: list[bytes] = []

    def walk(part: list[bytes], i: int) -> None:
        if len(part) == 1:
            return
        k = _split(len(part))
        if i < k:
            walk(part[:k], i)
            path.append(_root(part[k:]))
        else:
            walk(part[k:], i - k)
            path.append(_root(part[:k]))

    walk(hashes, index)
    return path


def verify(leaf: bytes, index: int, count: int, path: list[bytes], root: bytes) -> bool:
    """Whether `leaf` is leaf `index` of a `count`-leaf tree with this root."""
    if not 0 <= index < count:
        return False
    # Rebuild the path's left/right turns from (index, count), top-down, then fold bottom-up.
    turns: list[bool] = []  # True: our subtree is the left one
    i, n = index, count
    while n > 1:
        k = _split(n)
        if i < k:
            turns.append(True)
            n = k
        else:
            turns.append(False)
            i, n = i - k, n - k
    if len(turns) != len(path):
        return False
    value = leaf_hash(leaf)
    for left, sibling in zip(reversed(turns), path):
        value = _node(value, sibling) if left else _node(sibling, value)
    return value == root
