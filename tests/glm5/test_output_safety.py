"""Writers of outputs (issue 21): reports are replaced in one step, one writer holds an output at a
time, a directory swap survives a kill at every step where the filesystem has no RENAME_EXCHANGE, and
a failing save is one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from glm5.infra import fsio

_ROOT = Path(__file__).resolve().parents[2]


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
    assert not lock.exists()  # and no lock file is left beside the user's output


def test_a_lock_taken_on_a_removed_lock_file_is_taken_again_on_the_current_one(tmp_path, monkeypatch):
    """A process that opened the lock file just before its holder removed it must not count a lock on
    that orphan: the path then names another file, which a third process may hold."""
    lock = tmp_path / ".run.lock"
    real_open, opened = os.open, []

    def open_then_holder_finishes(path, *args):
        fd = real_open(path, *args)
        if not opened:  # the first open got the holder's file; the holder removes it and a new one appears
            os.unlink(path)
            lock.write_text("")
        opened.append(fd)
        return fd

    monkeypatch.setattr(fsio.os, "open", open_then_holder_finishes)
    with fsio.exclusive(lock, tmp_path / "run"):
        assert len(opened) == 2  # locked again, on the file the path names now
        monkeypatch.setattr(fsio.os, "open", real_open)
        with pytest.raises(fsio.OutputBusy):
            with fsio.exclusive(lock, tmp_path / "run"):
                pass


# a writer on a filesystem without RENAME_EXCHANGE, killed (SIGKILL) just before its Nth rename
_NO_EXCHANGE_WRITER = textwrap.dedent(
    """
    import ctypes, os, signal, sys
    from pathlib import Path
    from glm5.infra import fsio

    class LibcWithoutRenameat2:  # as an old libc: renameat2 is not there (ENOSYS)
        def __init__(self, *args, **kwargs):
            pass

    ctypes.CDLL = LibcWithoutRenameat2
    parent, value, kill_before = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    renames = 0

    def rename(a, b, _real=os.rename):
        global renames
        renames += 1
        if renames == kill_before:
            os.kill(os.getpid(), signal.SIGKILL)
        _real(a, b)

    os.rename = os.replace = rename
    tmp = fsio.staging_dir(parent, ".ckpt.tmp-")
    for name in ("a", "b"):
        (tmp / name).write_text(value)
    fsio.publish_dir(tmp, parent / "ckpt", ".ckpt.tmp-")
    """
)


def _write(parent, value, kill_before=0):
    return subprocess.run(
        [sys.executable, "-c", _NO_EXCHANGE_WRITER, str(parent), value, str(kill_before)],
        cwd=_ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    ).returncode


def _complete_copies(parent):
    """Versions of the complete copies at `ckpt` or under a name the next writer restores (not in the
    staging directories, which the next writer removes)."""
    names = [p for p in parent.iterdir() if p.name == "ckpt" or p.name.startswith(".ckpt.old-")]
    return {int((p / "a").read_text()) for p in names if (p / "a").is_file() and (p / "b").is_file()}


def test_without_rename_exchange_a_kill_at_any_rename_never_loses_the_last_complete_copy(tmp_path):
    assert _write(tmp_path, "0") == 0
    published = 0
    # a kill before each rename of a replacing save, and reruns killed in turn (the old code's rerun
    # deleted the copy set aside by the first kill, then died before publishing: nothing was left)
    for version, kill_before in enumerate([2, 1, 2, 3, 1, 2, 1], start=1):
        rc = _write(tmp_path, str(version), kill_before)
        copies = _complete_copies(tmp_path)
        assert copies and max(copies) >= published, (version, kill_before, copies)
        published = version if rc == 0 else published
    assert _write(tmp_path, "99") == 0
    assert (tmp_path / "ckpt" / "a").read_text() == "99"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing set aside is left behind


def test_recover_restores_the_copy_set_aside_and_drops_trash(tmp_path):
    assert _write(tmp_path, "0") == 0
    assert _write(tmp_path, "1", kill_before=2) != 0  # killed between the two renames
    assert not (tmp_path / "ckpt").exists() and _complete_copies(tmp_path) == {0}
    assert fsio.recover(tmp_path) == [tmp_path / "ckpt"]
    assert (tmp_path / "ckpt" / "a").read_text() == "0"
    trash = tmp_path / f".ckpt.trash-{_dead_pid()}-0a"
    trash.mkdir()
    fsio.recover(tmp_path)
    assert not trash.exists()


def test_a_reader_of_a_copy_set_aside_names_it_and_changes_nothing(tmp_path):
    """Between a killed swap and the next writer, `--model .../latest` names where the copy is."""
    from glm5.core.checkpoint import NotACheckpoint, check_dir

    assert _write(tmp_path, "0") == 0
    assert _write(tmp_path, "1", kill_before=2) != 0  # killed between the two renames
    (tmp_path / "latest").symlink_to("ckpt")  # as checkpoints/latest names step-N
    before = sorted(p.name for p in tmp_path.iterdir())
    for name in ("ckpt", "latest"):
        with pytest.raises(NotACheckpoint, match=r"set the previous copy aside as .*\.ckpt\.old-"):
            check_dir(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # a reader only reports


def _dead_pid() -> int:
    p = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(p.stdout)


# -- the quantize and export-onnx commands ------------------------------------------------------------


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM

    path = tmp_path_factory.mktemp("float") / "float"
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
    model.init_weights(0)
    model.save_pretrained(path)
    return path


def _cli(*args):
    from click.testing import CliRunner

    from glm5.cli import main

    return CliRunner().invoke(main, list(map(str, args)))


def _one_error(res, code, *words):
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert res.exit_code == code, (res.output, repr(res.exception))
    assert len(errors) == 1 and all(w in errors[0] for w in words), res.output
    assert "Traceback" not in res.output


def _fp8(src, out, *extra):
    return _cli("quantize", "--model", src, "--format", "fp8", "--out", out, "--quiet", *extra)


def test_quantize_fp8_refuses_a_recipe_or_calibration_it_would_ignore(float_ckpt, tmp_path):
    for extra, name in (
        (["--recipe", "glm5-w8a8"], "--recipe"),
        (["--group-size", "32"], "--group-size"),
        (["--calib-seqs", "4"], "--calib-seqs"),
    ):
        _one_error(_fp8(float_ckpt, tmp_path / "q", *extra), 2, f"'{name}'", "fp8")
    assert not (tmp_path / "q").exists()


def test_quantize_second_writer_is_refused_while_the_first_holds_out(float_ckpt, tmp_path):
    out = tmp_path / "q"
    with fsio.exclusive(fsio.lock_path(out), out):  # as a quantize running on it holds it
        _one_error(_fp8(float_ckpt, out), 2, "'--out'", f"pid {os.getpid()}")
    assert not out.exists()
    assert _fp8(float_ckpt, out).exit_code == 0
    _one_error(_fp8(float_ckpt, out), 2, "'--out'", "--overwrite")  # after it: exists


def test_export_onnx_second_writer_is_refused(tmp_path):
    pytest.importorskip("onnxscript")
    out = tmp_path / "m.onnx"
    with fsio.exclusive(fsio.lock_path(out), out):
        _one_error(_cli("export-onnx", "--preset", "tiny", "--out", out, "--quiet"), 2, "'--out'", "pid")
    assert not out.exists()


def test_export_onnx_checks_out_again_once_it_holds_the_lock(tmp_path, monkeypatch):
    """Another export may publish --out between the first check and the lock: never replace it."""
    pytest.importorskip("onnxscript")
    import glm5.onnx_export.export as export

    out = tmp_path / "m.onnx"
    real = export.one_writer

    def publish_then_lock(path, *args, **kwargs):
        out.write_text("another export's model")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(export, "one_writer", publish_then_lock)
    res = _cli("export-onnx", "--preset", "tiny", "--out", out, "--quiet")
    _one_error(res, 2, "'--out'", "already exists")
    assert out.read_text() == "another export's model"


def test_loss_plot_is_replaced_in_one_step(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import json

    from glm5.train.plots import plot_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": 3.0 - i / 10}) + "\n" for i in range(5)))
    written = []
    real = fsio.write_file_atomically
    monkeypatch.setattr(fsio, "write_file_atomically", lambda p, w: (written.append(p), real(p, w)))
    png = plot_metrics(metrics, tmp_path / "loss.png")
    assert written == [png] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]


def test_quantize_bad_out_paths_are_one_line(float_ckpt, tmp_path):
    (tmp_path / "loop").symlink_to("loop")
    for out, word in (
        ("", "--out"),
        (tmp_path / "loop", "not a directory"),
        (tmp_path / ("x" * 300), "File name too long"),
        (tmp_path / "a" / "..", "--out"),
    ):
        _one_error(_fp8(float_ckpt, out), 2, "'--out'", word)


def test_quantize_full_disk_is_one_line_and_leaves_out_as_it_was(float_ckpt, tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    out = tmp_path / "q"
    assert _fp8(float_ckpt, out).exit_code == 0
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    real = safetensors.torch.save_file

    def full(tensors, path, *args, **kwargs):
        if "part-00002" in str(path):
            raise SafetensorError(
                f'Error while serializing: I/O error: No space left on device (os error 28) at path "{path}"'
            )
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    _one_error(_fp8(float_ckpt, out, "--overwrite"), 1, "No space left on device", "part-00002")
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no staging (nor lock file) left


def test_quantize_puts_back_an_out_a_killed_overwrite_set_aside(float_ckpt, tmp_path):
    out = tmp_path / "q"
    assert _fp8(float_ckpt, out).exit_code == 0
    out.rename(tmp_path / f".q.old-{_dead_pid()}-0b")  # killed between the two renames (no EXCHANGE)
    _one_error(_fp8(float_ckpt, out), 2, "'--out'", "--overwrite")  # it is back: not replaced unasked
    assert (out / "config.json").is_file()


def test_without_rename_exchange_a_failing_second_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "a").write_text("old")
    tmp = fsio.staging_dir(tmp_path, ".ckpt.tmp-")
    (tmp / "a").write_text("new")
    monkeypatch.setattr(fsio, "_renameat2", lambda a, b, flags: 22)  # EINVAL: no RENAME_EXCHANGE here
    real, calls = os.rename, []

    def second_fails(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise OSError(28, os.strerror(28), str(b))
        real(a, b)

    monkeypatch.setattr(fsio.os, "rename", second_fails)
    with pytest.raises(OSError):
        fsio.publish_dir(tmp, path, ".ckpt.tmp-")
    assert (path / "a").read_text() == "old"
