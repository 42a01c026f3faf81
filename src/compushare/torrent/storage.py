"""Pieces on disk: a model's files, filled in piece by piece and verified against the manifest.

A file being downloaded lives at `<model dir>/.<name>.part`; each verified piece is
written at its offset there. When the last piece is in, the part file is fsynced
and renamed to its real name, so a model file exists only complete and verified,
whatever happens meanwhile - `kill -9` included. On restart the part file's pieces
are hashed again: the ones that match their manifest hash count as held (a piece
torn by a crash does not), and only the others are fetched. Everything on disk is
named by content: the model directory by the model id (the manifest's hash), and
the manifest names every piece by its SHA-256. Seeding reads pieces from the
complete files and from part files alike.

Everything here but `read_cached` may wait for the disk: async callers run it in
worker threads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

from ..model.store import StoredModel

log = logging.getLogger(__name__)

# preadv2's "fail rather than wait for the disk" flag (Linux 4.14+; None elsewhere).
_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def part_path(model: StoredModel, name: str) -> Path:
    return model.path / f".{name}.part"


class ModelPieces:
    """The pieces of one model this node holds: a bitfield, reads for seeding,
    verified writes for downloading."""

    def __init__(self, model: StoredModel) -> None:
        self.model, self.manifest = model, model.manifest
        self._lock = threading.Lock()
        # Called (in the trio thread, via announce) for each piece gained: seeders tell
        # their downloaders with `have`.
        self.listeners: set = set()
        self._held_files = model.held_files()
        self._finishing: set[int] = set()  # complete files being checked and renamed
        self.have: set[int] = set()
        for f, entry in enumerate(self.manifest.files):
            pieces = self.manifest.file_pieces(f)
            if entry.size == 0 and f not in self._held_files:  # no pieces to wait for
                (model.path / entry.name).touch()
                self._held_files.add(f)
            if f in self._held_files:
                self.have.update(pieces)
                part_path(model, entry.name).unlink(missing_ok=True)  # a stale copy
            elif part_path(model, entry.name).exists():
                try:
                    verified = self._verified_in_part(f)
                except FileNotFoundError:  # another process on this data dir just renamed it
                    self._finished_elsewhere(f)
                    continue
                self.have.update(verified)
                if len(verified) == len(pieces):  # killed between its last piece and the rename
                    self._finishing.add(f)
                    self._finish(f)

    def _verified_in_part(self, file_index: int) -> list[int]:
        """Pieces of a part file (left by an earlier run) that match their hashes."""
        good = []
        with open(part_path(self.model, self.manifest.files[file_index].name), "rb") as handle:
            for i in self.manifest.file_pieces(file_index):
                piece = self.manifest.pieces[i]
                handle.seek(piece.offset)
                if hashlib.sha256(handle.read(piece.length)).hexdigest() == piece.sha256:
                    good.append(i)
        return good

    @property
    def num_pieces(self) -> int:
        return len(self.manifest.pieces)

    def read(self, index: int) -> bytes:
        """One piece's bytes (KeyError if not held)."""
        data = self._read(index, cached_only=False)
        assert data is not None
        return data

    def read_cached(self, index: int, headroom: int = 0) -> bytearray | None:
        """One piece's bytes if the page cache holds all of them, else None, without
        ever waiting for the disk (KeyError if not held). A seeder serves hot pieces
        this way on its event loop: a worker-thread hop per piece costs more CPU than
        the copy (docs/performance.md), and the CPU is what a swarm on a
        small machine runs out of. The piece starts `headroom` bytes into the buffer
        (the seeder puts its frame's head there)."""
        if _NOWAIT is None:
            return None
        return self._read(index, cached_only=True, headroom=headroom)

    def _read(self, index: int, *, cached_only: bool, headroom: int = 0) -> bytes | bytearray | None:
        piece = self.manifest.pieces[index]
        name = self.manifest.files[piece.file].name
        # A download's writer holds the lock across a pwrite, which the kernel may
        # throttle: the event loop never waits for it (the thread read will).
        if not self._lock.acquire(blocking=not cached_only):
            return None
        try:
            if index not in self.have:
                raise KeyError(index)
            paths = [self.model.path / name, part_path(self.model, name)]
            if piece.file not in self._held_files:
                paths.reverse()
        finally:
            self._lock.release()
        for path in paths:  # the part may be renamed into place between the check and the open
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                if not cached_only:
                    return os.pread(fd, piece.length, piece.offset)
                buffer = bytearray(headroom + piece.length)
                try:
                    got = os.preadv(fd, [memoryview(buffer)[headroom:]], piece.offset, _NOWAIT)
                except BlockingIOError:
                    return None
                return buffer if got == piece.length else None
            finally:
                os.close(fd)
        raise KeyError(index)

    def write(self, index: int, data: bytes) -> bool:
        """Keep a downloaded piece if it matches its hash (False otherwise: nothing is
        written). Writing a piece twice is harmless: same hash, same bytes. When the
        file's last piece is in, the whole part file is checked again, then renamed."""
        piece = self.manifest.pieces[index]
        if len(data) != piece.length or hashlib.sha256(data).hexdigest() != piece.sha256:
            return False
        entry = self.manifest.files[piece.file]
        path = part_path(self.model, entry.name)
        with self._lock:  # hashing above runs in parallel; the disk takes one write at a time
            if index in self.have or piece.file in self._held_files:
                return True
            if self._finished_elsewhere(piece.file):
                return True
            # Only a file's first piece here may create its part file: if the part
            # vanished later (another process on this data dir finished the file),
            # writing on would leave a part with holes that `have` calls complete.
            first = self.have.isdisjoint(self.manifest.file_pieces(piece.file))
            try:
                fd = os.open(path, os.O_WRONLY | (os.O_CREAT if first else 0), 0o644)
            except FileNotFoundError:
                if self._finished_elsewhere(piece.file):
                    return True
                self.have.difference_update(self.manifest.file_pieces(piece.file))  # start the file over
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, data, piece.offset)
            finally:
                os.close(fd)
            self.have.add(index)
            complete = piece.file not in self._finishing and all(
                i in self.have for i in self.manifest.file_pieces(piece.file))
            if complete:
                self._finishing.add(piece.file)  # claimed: one writer finishes the file
        if complete:
            self._finish(piece.file)
        return True

    def _finished_elsewhere(self, file_index: int) -> bool:
        """Another process on this data dir completed the file: take it (lock held)."""
        entry = self.manifest.files[file_index]
        try:
            if (self.model.path / entry.name).stat().st_size != entry.size:
                return False
        except FileNotFoundError:
            return False
        self._held_files.add(file_index)
        self.have.update(self.manifest.file_pieces(file_index))
        return True

    def _finish(self, file_index: int) -> None:
        """fsync the complete part file and rename it to its real name. Every piece in it
        was verified before it was written, and only this object writes it."""
        entry = self.manifest.files[file_index]
        path = part_path(self.model, entry.name)
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, entry.size)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(path, self.model.path / entry.name)
        except FileNotFoundError:
            # Another process on this data dir (a `models fetch` beside the daemon) held
            # the same complete part file and renamed it first: the file is done.
            with self._lock:
                self._finishing.discard(file_index)
                if not self._finished_elsewhere(file_index):
                    raise
            return
        except BaseException:
            with self._lock:
                self._finishing.discard(file_index)
            raise
        with self._lock:
            self._finishing.discard(file_index)
            self._held_files.add(file_index)
        log.info("completed %s (%d pieces)", entry.name, len(self.manifest.file_pieces(file_index)))

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
        self._open: dict[str, ModelPieces] = {}
        self._opening = None  # a trio.Lock, made on first use inside trio

    async def open(self, model_id: str) -> ModelPieces | None:
        """`pieces` for async callers: opening a model after a crash re-hashes its part
        files, which must not stall the event loop."""
        import trio

        if model_id in self._open:
            return self._open[model_id]
        if self._opening is None:
            self._opening = trio.Lock()
        async with self._opening:  # one ModelPieces per model, however many ask at once
            return await trio.to_thread.run_sync(self.pieces, model_id)

    def pieces(self, model_id: str) -> ModelPieces | None:
        if model_id in self._open:
            return self._open[model_id]
        if len(model_id) != 64 or (self.only is not None and model_id not in self.only):
            return None  # seeding and fetching go by full id, never by local alias
        model = self.models.get(model_id)
        if model is None:
            return None
        self._open[model_id] = ModelPieces(model)
        return self._open[model_id]

    def model_ids(self) -> list[str]:
        return [m.model_id for _names, m in self.models.list() if self.only is None or m.model_id in self.only]

    def forget(self, model_id: str) -> None:
        """Stop seeding `model_id` and delete its files (a training run's old outer state):
        a peer fetching it then finds it not held here."""
        import shutil

        if self.only is not None:
            self.only.discard(model_id)
        self._open.pop(model_id, None)
        model = self.models.get(model_id)
        if model is not None and len(model_id) == 64:
            shutil.rmtree(model.path, ignore_errors=True)
