"""Writers of outputs (issue 21): reports are replaced in one step, one writer holds an output at a
time, a directory swap survives a kill at every step where the filesystem has no RENAME_EXCHANGE, and
a failing save is one line."""

from __future__ import annotations

import os

import pytest

from glm5 import fsio


def test_write_text_atomic_keeps_the_old_text_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    fsio.write_text_atomic(path, "old\n")

    def full_disk(fd):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(fsio.os, "fsync", full_disk)
    with pytest.raises(OSError):
        fsio.write_text_atomic(path, "new\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temporary left
    monkeypatch.undo()
    fsio.write_text_atomic(str(path), "new\n")
    assert path.read_text() == "new\n"
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path):
    out = tmp_path / "run"
    lock = fsio.lock_path(out)
    assert lock.parent == tmp_path and lock.name == ".run.lock"
    with fsio.exclusive(lock, out):
        with pytest.raises(fsio.OutputBusy, match=rf"{out}.*pid {os.getpid()}"):
            with fsio.exclusive(lock, out):
                pass
    with fsio.exclusive(lock, out):  # released at the end of the block
        pass
