"""Crash-safe file operations shared by every writer and reader of checkpoints.

- A directory is built in a staging sibling (`.NAME.tmp-PID-XXXX`) and swapped into place with one
  atomic `renameat2(RENAME_EXCHANGE)`, so at every instant the path holds the old checkpoint or the new
  one, never nothing. Staging directories of dead processes (a kill during a save) are removed by the
  next save next to them.
- Everything written is fsynced (files, then their directory) before it is published.
- Files get the modes of ordinary files (0666 & ~umask; directories 0777 & ~umask): a serving process
  running as another user must be able to read a checkpoint. safetensors and mkdtemp create 0600/0700.
- One writer per output: `exclusive(lock_path(out))` holds an flock for the run; a second writer gets
  OutputBusy naming the output and the holder's pid (the lock dies with its process: no stale locks).
- Readers open only regular files inside the directory the user named (`inside`): a checkpoint index
  naming `../x`, an absolute path, a symlink out of the directory, `/proc/...` or a FIFO is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    return 0o666 & ~_umask()


def dir_mode() -> int:
    return 0o777 & ~_umask()


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """Write, chmod to an ordinary file's mode, fsync."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, file_mode())


def write_file_atomically(path: Path, write) -> None:
    """Create or replace the file `path` in one step: `write(tmp)` fills a temporary sibling, which is
    fsynced, given an ordinary file's mode and renamed over `path`; a kill leaves the old file (or none)
    and at most a `.NAME.tmp-PID-*` sibling, never half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, file_mode())
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Create or replace the text file `path` in one step (temporary sibling, fsync, rename, fsync of the
    directory): a concurrent reader sees the old text or the new, a full disk leaves the old file."""

    def _write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    write_file_atomically(Path(path), _write)


class OutputBusy(RuntimeError):
    """Another process is writing the same output (it holds the output's lock)."""


def lock_path(out: str | Path) -> Path:
    """The lock file of the output `out` (a file or a directory swapped in whole): `.NAME.lock` beside it,
    so the lock outlives the swaps that replace `out`."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def exclusive(lock: str | Path, what: str | Path | None = None) -> Iterator[None]:
    """Hold an exclusive flock on the file `lock` (created if missing; it stays, empty of meaning, after
    the block) for the block; OutputBusy at once, naming `what` (default: the lock) and the holder's pid,
    if another process holds it."""
    lock = Path(lock)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode())
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            who = f"pid {holder}" if holder.isdigit() else "pid unknown"
            raise OutputBusy(f"{what or lock} is being written by another process ({who}); wait for it to "
                             "finish or choose another output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def save_tensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    save_file(tensors, path, metadata=metadata)
    os.chmod(path, file_mode())
    fsync_path(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(parent: Path, prefix: str) -> list[Path]:
    """Remove `parent/{prefix}{PID}-*` directories whose process is gone (left by a killed save)."""
    removed = []
    pat = re.compile(re.escape(prefix) + r"(\d+)-")
    if not parent.is_dir():
        return removed
    for p in parent.iterdir():
        m = pat.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def staging_dir(parent: Path, prefix: str) -> Path:
    """A fresh staging directory `parent/{prefix}{PID}-XXXX` (mode of an ordinary directory), after
    removing the stale ones a killed process left there."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale(parent, prefix)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    os.chmod(tmp, dir_mode())
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the kernel or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(tmp: Path, path: Path, prefix: str) -> None:
    """Put the complete directory `tmp` (made by `staging_dir(path.parent, prefix)`) at `path`, replacing
    what is there, and delete the old one.

    With RENAME_EXCHANGE there is no instant without a checkpoint at `path`; where the filesystem lacks
    it, the old directory is renamed aside first (a short window, and the old copy survives a kill as a
    staging directory until the next save removes it)."""
    for f in tmp.rglob("*"):
        if f.is_file():
            fsync_path(f)
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        fsync_path(d)
    if path.exists() or path.is_symlink():
        if not path.is_dir() or path.is_symlink():
            raise FileExistsError(f"{path} exists and is not a directory: refusing to replace it")
        if not _exchange(tmp, path):
            aside = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=path.parent))
            os.replace(path, aside / path.name)
            os.replace(tmp, path)
            tmp = aside
        shutil.rmtree(tmp, ignore_errors=True)  # the old directory, now under the staging name
    else:
        os.replace(tmp, path)
    fsync_path(path.parent)


def point_symlink(link: Path, target: str) -> None:
    """Make `link` a symlink to `target` (relative), replacing it atomically (a file or an old link)."""
    tmp = link.parent / f".{link.name}.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fsync_path(link.parent)


def inside(root: Path, name: str, what: str) -> Path:
    """`root/name` if it is a regular file inside `root` (after resolving symlinks); else ValueError
    naming `what` (e.g. the index file) and the entry."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name:
        raise ValueError(f"{what}: expected a file name inside {root}, got {name!r}")
    parts = Path(name).parts
    if ".." in parts:
        raise ValueError(f"{what}: expected a file name inside {root}, got {name!r} (leaves the directory)")
    real_root = root.resolve()
    p = (root / name).resolve()
    if real_root not in p.parents:
        raise ValueError(f"{what}: {name!r} resolves to {p}, outside {real_root}")
    regular_file(p, what)
    return root / name


def regular_file(p: Path, what: str) -> None:
    """ValueError unless `p` is a regular file (a FIFO or device would block or never end)."""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ValueError(f"{what}: {p} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what}: {p} is not a regular file")
