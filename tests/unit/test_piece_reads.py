"""torrent/storage.py: a seeder's reads, from the page cache on the event loop or
from the disk in a thread, return the same verified bytes."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from compushare.model.catalog import import_path
from compushare.model.store import ModelStore
from compushare.torrent.storage import ModelPieces

needs_nowait = pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="preadv2 RWF_NOWAIT is Linux-only")


@pytest.fixture
def pieces(tiny_model, tmp_path) -> ModelPieces:
    model_id = import_path(tiny_model, tmp_path / "home", alias="tiny").model_id
    return ModelPieces(ModelStore(tmp_path / "home").get(model_id))


def _matches(pieces: ModelPieces, index: int, data) -> bool:
    return hashlib.sha256(data).hexdigest() == pieces.manifest.pieces[index].sha256


@needs_nowait
def test_a_piece_in_the_page_cache_is_read_without_the_disk_and_equals_the_blocking_read(pieces):
    for index in range(pieces.num_pieces):
        pieces.read(index)  # now in the page cache
        cached = pieces.read_cached(index)
        assert cached is not None
        assert bytes(cached) == pieces.read(index)
        assert _matches(pieces, index, cached)


@needs_nowait
def test_a_cached_read_with_headroom_puts_the_piece_after_it(pieces):
    # The seeder fills the headroom with its frame's head: one buffer, one copy of the piece.
    pieces.read(0)
    buffer = pieces.read_cached(0, headroom=13)
    assert buffer is not None and len(buffer) == 13 + pieces.manifest.pieces[0].length
    assert buffer[:13] == bytes(13)
    assert bytes(buffer[13:]) == pieces.read(0)


@needs_nowait
def test_a_piece_evicted_from_the_page_cache_is_not_read_on_the_loop(pieces):
    # Clean pages dropped with POSIX_FADV_DONTNEED: a read would have to wait for the disk.
    # The import hard-links the session's model files, which other tests' processes may
    # have mapped (mapped pages stay): each file first becomes a private copy.
    paths = [pieces.model.path / entry.name for entry in pieces.manifest.files]
    for path in paths:
        copy = path.with_name(path.name + ".copy")
        copy.write_bytes(path.read_bytes())
        os.replace(copy, path)
    # DONTNEED skips pages still queued on another CPU's LRU list: try a few times.
    for _ in range(20):
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if pieces.read_cached(0) is None:  # (a miss may start readahead: counted here)
            evicted = 1
            assert _matches(pieces, 0, pieces.read(0))  # the thread's read still works
            break
        time.sleep(0.05)
    else:
        evicted = 0
    for index in range(1, pieces.num_pieces):
        if pieces.read_cached(index) is None:
            evicted += 1
            assert _matches(pieces, index, pieces.read(index))
    if evicted == 0:
        pytest.skip("this file system kept the pages (tmpfs): nothing to evict")


def test_a_piece_not_held_is_a_key_error_either_way(pieces):
    pieces.have.discard(0)
    with pytest.raises(KeyError):
        pieces.read(0)
    with pytest.raises(KeyError):
        pieces.read_cached(0)


@needs_nowait
def test_the_loop_never_waits_for_a_writer_holding_the_lock(pieces):
    pieces.read(0)  # cached
    with pieces._lock:  # as a download's pwrite holds it
        assert pieces.read_cached(0) is None  # the seeder falls back to a thread
    assert pieces.read_cached(0) is not None


def test_a_part_file_complete_at_start_is_renamed_into_place(tiny_model, tmp_path):
    """A download killed between a file's last piece and its rename leaves a complete,
    verified part file: the next run's storage finishes it (no piece will come again
    to trigger that), so the model is held whole."""
    from compushare.torrent.storage import part_path

    model_id = import_path(tiny_model, tmp_path / "home", alias="tiny").model_id
    model = ModelStore(tmp_path / "home").get(model_id)
    entry = model.manifest.files[-1]
    os.replace(model.path / entry.name, part_path(model, entry.name))
    model = ModelStore(tmp_path / "home").get(model_id)
    assert not model.holds(blocks=(0, model.num_blocks), head=True)
    pieces = ModelPieces(model)
    assert (model.path / entry.name).exists() and not part_path(model, entry.name).exists()
    assert set(model.manifest.file_pieces(len(model.manifest.files) - 1)) <= pieces.have
    assert ModelStore(tmp_path / "home").get(model_id).holds(blocks=(0, model.num_blocks), head=True)


def test_a_complete_part_file_renamed_by_another_process_first_is_taken_as_finished(
        tiny_model, tmp_path, monkeypatch):
    # A `models fetch` beside the daemon on one data dir: both may find the same complete
    # part file (killed between the last piece and the rename) and race to rename it.
    from compushare.torrent import storage
    model_id = import_path(tiny_model, tmp_path / "home", alias="tiny").model_id
    model = ModelStore(tmp_path / "home").get(model_id)
    index = max(range(len(model.manifest.files)), key=lambda f: model.manifest.files[f].size)
    entry = model.manifest.files[index]
    real = model.path / entry.name
    original = real.read_bytes()
    real.unlink()
    storage.part_path(model, entry.name).write_bytes(original)
    real_replace = os.replace

    def the_other_process_wins(src, dst):
        real_replace(src, dst)  # the other process renames first ...
        real_replace(src, dst)  # ... so ours finds no part file
    monkeypatch.setattr(storage.os, "replace", the_other_process_wins)
    pieces = ModelPieces(ModelStore(tmp_path / "home").get(model_id))
    assert set(pieces.manifest.file_pieces(index)) <= pieces.have
    assert index in pieces.held_files()
    assert real.read_bytes() == original
