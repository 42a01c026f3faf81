"""The node's persistent Ed25519 identity, kept in its data dir."""

from __future__ import annotations

import os
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from ..errors import UsageError

KEY_FILE = "identity.ed25519"


def load_or_create_identity(data_dir: Path) -> KeyPair:
    """Load the 32-byte Ed25519 seed from `data_dir`, creating it (mode 0600) if absent."""
    path = data_dir / KEY_FILE
    if path.exists():
        seed = path.read_bytes()
        if len(seed) != 32:
            raise UsageError(f"{path} is not a 32-byte Ed25519 seed; remove it to make a new identity")
        return create_new_key_pair(seed)
    key_pair = create_new_key_pair()
    seed = key_pair.private_key.to_bytes()
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(seed)
    os.replace(tmp, path)
    return key_pair


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)
