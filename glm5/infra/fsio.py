"""Crash-safe file operations shared by every writer and reader of checkpoints.

- A directory is built in a staging sibling (`.NAME.tmp-PID-XXXX`) and swapped into place with one
  atomic `renameat2(RENAME_EXCHANGE)`, so at every instant the path holds the old checkpoint or the new
  one, never nothing. Without RENAME_EXCHANGE the old one is renamed to `.NAME.old-PID-XXXX` first,
  which the next writer (`recover`) restores if the new one never arrived. Staging directories of dead
  processes (a kill during a save) are removed by the next save next to them.
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by save_tensors only: the lock and text writers work without it
    import torch

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


def describe(exc: OSError) -> str:
    """One line for a failed file operation: the path and the errno's text (e.g. "/data/run/x: No space
    left on device")."""
    what = exc.strerror or (str(exc).splitlines() or [type(exc).__name__])[0]
    return f"{exc.filename}: {what}" if exc.filename is not None else what


class OutputBusy(RuntimeError):
    """Another process is writing the same output (it holds the output's lock)."""


def lock_path(out: str | Path) -> Path:
    """The lock file of the output `out` (a file or a directory swapped in whole): `.NAME.lock` beside it,
    so the lock outlives the swaps that replace `out`."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def exclusive(lock: str | Path, what: str | Path | None = None) -> Iterator[None]:
    """Hold an exclusive flock on the file `lock` (created if missing, removed when the block ends, so no
    lock file is left beside a user's output) for the block; OutputBusy at once, naming `what` (default:
    the lock) and the holder's pid, if another process holds it.

    Removing a lock file is safe only with a check after locking: a process that opened the old file just
    before its holder removed it would otherwise lock an orphan while a third process locks the new file.
    So a lock counts only if the path still names the locked file; otherwise it is taken again."""
    lock = Path(lock)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "pid unknown"
            raise OutputBusy(
                f"{what or lock} is being written by another process ({who}); wait for it to "
                "finish or choose another output"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            st = os.stat(lock, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        mine = os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)  # an orphan its holder removed while we opened it: lock the file the path names now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # still holding the lock: nobody can have locked this file meanwhile
        os.close(fd)  # releases the lock


def save_tensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write a safetensors file, chmod it to an ordinary file's mode, fsync; a failing write (a full
    disk) is an OSError naming `path` and the errno, as Python's own writes raise."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as exc:  # the Rust writer reports "I/O error: ... (os error 28)"
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        err = int(code.group(1))
        raise OSError(err, os.strerror(err), str(path)) from exc
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


# A directory replaced without RENAME_EXCHANGE is first renamed to `.NAME.old-PID-XXXX` (a complete copy
# the next writer restores if NAME is missing); one being removed is renamed to `.NAME.trash-PID-XXXX`
# (never restored, never read) before it is deleted.
_SET_ASIDE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>old|trash)-(?P<pid>\d+)-[0-9a-z]+$")


def _aside_name(path: Path, kind: str) -> Path:
    while True:
        p = path.parent / f".{path.name}.{kind}-{os.getpid()}-{os.urandom(4).hex()}"
        if not (p.exists() or p.is_symlink()):
            return p


def recover(parent: Path) -> list[Path]:
    """Finish what a killed writer left in `parent`: a directory set aside for a swap (`.NAME.old-*`) is
    renamed back to NAME when NAME is missing (the newest such copy), else deleted (NAME holds the new
    one); a directory being removed (`.NAME.trash-*`) is deleted. Entries of live processes are left
    alone. Returns the restored paths."""
    if not parent.is_dir():
        return []
    aside: dict[str, list[Path]] = {}
    for p in parent.iterdir():
        m = _SET_ASIDE.match(p.name)
        if not m or not p.is_dir() or p.is_symlink() or _pid_alive(int(m["pid"])):
            continue
        if m["kind"] == "trash":
            shutil.rmtree(p, ignore_errors=True)
        else:
            aside.setdefault(m["name"], []).append(p)
    restored = []
    for name, copies in aside.items():
        target = parent / name
        copies.sort(key=lambda p: p.stat().st_ctime)
        if not (target.exists() or target.is_symlink()):
            os.rename(copies.pop(), target)
            fsync_path(parent)
            restored.append(target)
        for p in copies:  # NAME holds a complete copy: these are older ones
            shutil.rmtree(p, ignore_errors=True)
    return restored


def set_aside(path: Path) -> list[Path]:
    """The copies of the directory `path` that a killed writer set aside for a swap (`.NAME.old-*` beside
    it), newest first: what `recover` would restore. For readers, which only report them."""
    parent = path.parent
    if not parent.is_dir():
        return []
    found = []
    for p in parent.iterdir():
        m = _SET_ASIDE.match(p.name)
        if m and m["name"] == path.name and m["kind"] == "old" and p.is_dir():
            found.append(p)
    return sorted(found, key=lambda p: p.stat().st_ctime, reverse=True)


def remove_dir(path: Path) -> None:
    """Delete the directory `path` so that no reader ever sees it half-deleted: it is renamed to a trash
    name first (one step), then deleted; a kill in between leaves the trash for `recover`."""
    trash = _aside_name(path, "trash")
    os.rename(path, trash)
    fsync_path(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def staging_dir(parent: Path, prefix: str) -> Path:
    """A fresh staging directory `parent/{prefix}{PID}-XXXX` (mode of an ordinary directory), after
    finishing what a killed writer left there (`recover`) and removing its staging directories."""
    parent.mkdir(parents=True, exist_ok=True)
    recover(parent)
    remove_stale(parent, prefix)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    os.chmod(tmp, dir_mode())
    return tmp


def _renameat2(a: Path, b: Path, flags: int) -> int:
    """renameat2(2): 0, or the errno (ENOSYS where libc has no renameat2)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return errno.ENOSYS
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return 0
    return ctypes.get_errno()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the kernel or filesystem cannot."""
    err = _renameat2(a, b, _RENAME_EXCHANGE)
    if err == 0:
        return True
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(tmp: Path, path: Path, prefix: str) -> None:
    """Put the complete directory `tmp` (made by `staging_dir(path.parent, prefix)`) at `path`, replacing
    what is there, and delete the old one.

    With RENAME_EXCHANGE there is no instant without a checkpoint at `path`. Where the filesystem lacks
    it (NFS, some overlay filesystems) the old directory is renamed to `.NAME.old-PID-XXXX` first and the
    new one into place second: a kill between the two leaves the old copy complete under a name that
    `recover` (run by the next `staging_dir` here, and by readers that call it) renames back, and that
    no cleanup of staging directories deletes."""
    for f in tmp.rglob("*"):
        if f.is_file():
            fsync_path(f)
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        fsync_path(d)
    if path.exists() or path.is_symlink():
        if not path.is_dir() or path.is_symlink():
            raise FileExistsError(f"{path} exists and is not a directory: refusing to replace it")
        if _exchange(tmp, path):
            shutil.rmtree(tmp, ignore_errors=True)  # the old directory, now under the staging name
        else:
            old = _aside_name(path, "old")
            os.rename(path, old)
            fsync_path(path.parent)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)  # an error (not a kill): the old one goes straight back
                raise
            fsync_path(path.parent)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
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
    try:
        real_root, p = root.resolve(), (root / name).resolve()
    except (RuntimeError, OSError) as exc:  # Python 3.11 raises RuntimeError on a symlink loop
        raise ValueError(f"{what}: {name!r} cannot be resolved ({exc})") from None
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


def one_writer(
    out: str | Path, lock: str | Path | None = None, hint: str = "'--out'"
) -> contextlib.ExitStack:
    """Take the lock of the output `out` now (default `.NAME.lock` beside it, `exclusive`; its directory is
    made if missing), held until the returned stack closes (`with one_writer(out): ...`): a second writer of
    the same output is refused with a click usage error of one line naming `hint` and the holder's pid, as
    is a lock that cannot be made (every command line that writes an output: glm5's and conformance's)."""
    import click

    lock = Path(lock or lock_path(out))
    stack = contextlib.ExitStack()
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        stack.enter_context(exclusive(lock, out))
    except OutputBusy as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None
    except OSError as exc:
        raise click.BadParameter(describe(exc), param_hint=hint) from None
    return stack
