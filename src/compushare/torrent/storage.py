"""Pieces on disk: a content-addressed store of loose pieces, and model files assembled from them.

A downloaded piece is written to `<data dir>/pieces/<aa>/<sha256>` (temporary name,
fsync, rename), so after a crash - `kill -9` included - every file under its final
name holds exactly the bytes its name promises, and a restart refetches only
pieces that are not there. Once every piece of a model file is present, the file
is assembled next to the model's manifest the same way (temporary name, each piece
re-checked, fsync, rename) and its loose pieces are deleted. A model file
therefore exists only complete and verified; seeding reads pieces from whichever
of the two places holds them.

Everything here blocks on disk: async callers run it in worker threads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

from ..model.store import StoredModel

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"


def _write_atomically(path: Path, chunks) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class PieceStore:
    """Loose pieces named by their SHA-256."""

    def __init__(self, data_dir: Path) -> None:
        self.root = Path(data_dir) / "pieces"
        self.root.mkdir(parents=True, exist_ok=True)

    def clean(self) -> int:
        """Delete temporary files a crash left behind; how many there were."""
        leftovers = list(self.root.glob(f"*/{TMP_PREFIX}*"))
        for path in leftovers:
            path.unlink(missing_ok=True)
        return len(leftovers)

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).exists()

    def put(self, digest: str, data: bytes, verified: bool = False) -> bool:
        """Store `data` if it hashes to `digest` (`verified`: the caller just checked);
        False (nothing written) if not."""
        if not verified and hashlib.sha256(data).hexdigest() != digest:
            return False
        path = self.path(digest)
        path.parent.mkdir(exist_ok=True)
        _write_atomically(path, [data])
        return True

    def get(self, digest: str) -> bytes:
        return self.path(digest).read_bytes()

    def discard(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)


class ModelPieces:
    """The pieces of one model this node holds: a bitfield, reads for seeding,
    verified writes for downloading."""

    def __init__(self, model: StoredModel, store: PieceStore) -> None:
        self.model, self.store, self.manifest = model, store, model.manifest
        self._lock = threading.Lock()
        # Called (in the trio thread, via announce) for each piece gained: seeders tell
        # their downloaders with `have`.
        self.listeners: set = set()
        held_files = model.held_files()
        self._held_files = set(held_files)
        self.have: set[int] = set()
        for f in range(len(self.manifest.files)):
            pieces = self.manifest.file_pieces(f)
            if f in held_files:
                self.have.update(pieces)
            else:
                self.have.update(i for i in pieces if store.has(self.manifest.pieces[i].sha256))

    @property
    def num_pieces(self) -> int:
        return len(self.manifest.pieces)

    def read(self, index: int) -> bytes:
        """One piece's bytes (KeyError if not held)."""
        piece = self.manifest.pieces[index]
        with self._lock:
            if index not in self.have:
                raise KeyError(index)
            in_file = piece.file in self._held_files
        if in_file:
            with open(self.model.path / self.manifest.files[piece.file].name, "rb") as handle:
                handle.seek(piece.offset)
                return handle.read(piece.length)
        return self.store.get(piece.sha256)

    def write(self, index: int, data: bytes, verified: bool = False) -> bool:
        """Keep a downloaded piece if it matches its hash (False otherwise); assemble its
        file when it was the file's last missing piece."""
        piece = self.manifest.pieces[index]
        if len(data) != piece.length or not self.store.put(piece.sha256, data, verified):
            return False
        with self._lock:
            self.have.add(index)
            complete = piece.file not in self._held_files and all(
                i in self.have for i in self.manifest.file_pieces(piece.file))
        if complete:
            self._assemble(piece.file)
        return True

    def _assemble(self, file_index: int) -> None:
        entry = self.manifest.files[file_index]
        indexes = self.manifest.file_pieces(file_index)

        def chunks():
            for i in indexes:
                digest = self.manifest.pieces[i].sha256
                data = self.store.get(digest)
                if hashlib.sha256(data).hexdigest() != digest:  # the disk changed under us
                    raise OSError(f"piece {i} of {entry.name} is damaged on disk")
                yield data

        try:
            _write_atomically(self.model.path / entry.name, chunks())
        except OSError as exc:
            log.warning("could not assemble %s: %s; refetching its pieces", entry.name, exc)
            with self._lock:
                for i in indexes:
                    self.have.discard(i)
                    self.store.discard(self.manifest.pieces[i].sha256)
            return
        with self._lock:
            self._held_files.add(file_index)
        for i in indexes:
            self.store.discard(self.manifest.pieces[i].sha256)
        log.info("assembled %s (%d pieces)", entry.name, len(indexes))

    def announce(self, index: int) -> None:
        for listener in list(self.listeners):
            listener(index)

    def held_files(self) -> set[int]:
        with self._lock:
            return set(self._held_files)


class Library:
    """Every model this node can seed, by id, with one ModelPieces each (so a download
    and the seeding of the same model share one bitfield)."""

    def __init__(self, data_dir: Path, only: set[str] | None = None) -> None:
        from ..model.store import ModelStore

        self.only = only  # seed and fetch just these model ids (None: every model stored)
        self.models = ModelStore(Path(data_dir))
        self.store = PieceStore(Path(data_dir))
        self.store.clean()
        self._open: dict[str, ModelPieces] = {}

    def pieces(self, model_id: str) -> ModelPieces | None:
        if model_id in self._open:
            return self._open[model_id]
        if len(model_id) != 64 or (self.only is not None and model_id not in self.only):
            return None  # seeding and fetching go by full id, never by local alias
        model = self.models.get(model_id)
        if model is None:
            return None
        self._open[model_id] = ModelPieces(model, self.store)
        return self._open[model_id]

    def model_ids(self) -> list[str]:
        return [m.model_id for _names, m in self.models.list() if self.only is None or m.model_id in self.only]
