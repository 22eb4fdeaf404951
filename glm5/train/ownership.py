"""One owner per training run, in every process of it (`glm5 train`, and `--nproc N`'s launcher and ranks).

- The launcher (or the single process) holds `OUT/.lock` (glm5.infra.fsio.exclusive); each rank holds
  `OUT/.lock.rankR` for as long as it lives. A new writer takes `.lock` and then checks that no rank lock
  of an earlier run is still held, so orphaned ranks of a killed launcher are never joined by a second
  writer.
- A rank dies with its launcher: torch's elastic agent starts ranks in sessions of their own, so a SIGKILL
  of the launcher (an OOM kill, `kill -9`) reaches no rank. Each rank asks Linux for SIGKILL when its
  parent dies (prctl PR_SET_PDEATHSIG) and, on any POSIX system, a daemon thread polls its parent's pid.
- Ctrl-C and a dead rank end in one line: where the last checkpoint is and the command that resumes from
  it; exit 128 + the signal's number for an interrupted run, RANK_DIED (1) for a rank that died."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import click

from glm5.infra import fsio

RANK_LOCK = ".lock.rank"
#: exit code of `glm5 train --nproc N` when a rank died of a signal (one line names it)
RANK_DIED = 1
_PR_SET_PDEATHSIG = 1


def rank_lock(out: Path, rank: int) -> contextlib.ExitStack:
    """The lock a rank holds while it lives (released by the kernel when it dies, however it dies)."""
    from glm5.infra.fsio import one_writer

    return one_writer(out, Path(out) / f"{RANK_LOCK}{rank}")


def check_no_ranks(out: Path) -> None:
    """fsio.OutputBusy if a rank of an earlier run of `out` still holds its lock (its launcher died and
    it has not exited yet); the lock files of ranks that are gone are removed."""
    for path in sorted(Path(out).glob(f"{RANK_LOCK}*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or not a file we could have made
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                rank = path.name[len(RANK_LOCK) :]
                raise fsio.OutputBusy(
                    f"{out} is still being written by rank {rank} of an earlier run (pid "
                    f"{holder if holder.isdigit() else 'unknown'}); wait for it to exit"
                ) from None
            with contextlib.suppress(OSError):
                path.unlink()  # holding its lock: no rank holds this file
        finally:
            os.close(fd)


def die_with_launcher(launcher: int, period: float = 0.5) -> None:
    """In a rank: SIGKILL this process as soon as its parent, the launcher `launcher`, is gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(period)
        os.kill(os.getpid(), signal.SIGKILL)  # nothing of an orphan's half-done step is worth keeping

    if os.getppid() != launcher:  # it died before the death signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="glm5-launcher-watch", daemon=True).start()


def resume_command(argv: list[str] | None = None) -> str:
    """The `glm5 train` command line of this run with --resume (once)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(["glm5", *args])


def where_to_resume(out: Path, argv: list[str] | None = None) -> str:
    """'the last checkpoint is ...; continue with: ...' (or that there is none yet)."""
    from glm5.train.loop.state import latest_checkpoint

    ckpt = latest_checkpoint(Path(out) / "checkpoints")
    if ckpt is None:
        return "no checkpoint was written yet (run the command again to start over)"
    return f"the last checkpoint is {ckpt}; continue with: {resume_command(argv)}"


def interrupted(out: Path, sig: int = signal.SIGINT) -> click.ClickException:
    """The one line of a run stopped by Ctrl-C (SIGINT) or SIGTERM, exit 128 + the signal."""
    exc = click.ClickException(f"interrupted by {signal.Signals(sig).name}: {where_to_resume(out)}")
    exc.exit_code = 128 + int(sig)
    return exc


def rank_failure(failures: dict, out: Path) -> tuple[str | None, int]:
    """(the one line for the failed ranks of a launch, the launcher's exit code). A rank killed by a signal
    is named with its signal (a SIGTERM the agent sent to the survivors counts last); a rank that exited
    with a code printed its own line, and its code is the launcher's."""
    items = sorted(failures.items())
    killed = [(r, f) for r, f in items if f.exitcode < 0]
    if killed:
        by_other = [(r, f) for r, f in killed if -f.exitcode != signal.SIGTERM]
        rank, f = min(by_other or killed, key=lambda rf: (rf[1].timestamp, rf[0]))
        return (
            f"rank {rank} (pid {f.pid}) died of {f.signal_name()}; the other ranks were stopped: "
            f"{where_to_resume(out)}",
            RANK_DIED,
        )
    codes = [f.exitcode for _, f in items if f.exitcode]
    if codes and all(c == PEER_LOST for c in codes):
        rank = items[0][0]
        return f"rank {rank} lost contact with the other ranks: {where_to_resume(out)}", RANK_DIED
    return None, next((c for c in codes if c != PEER_LOST), 1)


def owner(out: Path) -> contextlib.ExitStack:
    """The locks this process of `glm5 train` holds on the run (inside the run directory: its parent may
    not be ours): the launcher or the single process `OUT/.lock` (and no rank of an earlier run left), a
    rank its own `OUT/.lock.rankR` (plain torchrun: rank 0 `OUT/.lock`); a rank started by `launch` also
    dies with it from now on."""
    from glm5.train.distributed import runtime as distributed

    ranked = distributed.under_torchrun()
    launched = ranked and distributed.lock_held_by_launcher()
    if launched:
        die_with_launcher(int(os.environ[distributed.LOCK_HOLDER_ENV]))
    if ranked and (launched or distributed.rank()):
        return rank_lock(out, distributed.rank())
    return run_lock(out, check_ranks=not ranked)


def launch(out: Path, nproc: int) -> None:
    """`--nproc N`'s launcher (the run's lock held): the ranks under torch elastic; SystemExit with the
    ranks' exit code if one failed (one line for a rank that died of a signal), `interrupted` on Ctrl-C."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from glm5.train.distributed import runtime as distributed

    sys.stdout.flush()
    quiet_agent()
    try:
        failures = distributed.launch(sys.argv[1:], nproc)
    except SignalException as exc:  # the agent stopped the ranks
        raise interrupted(out, exc.sigval) from None
    line, code = rank_failure(failures, out)
    if line is not None:
        click.echo(f"Error: {line}", err=True)
    if failures:
        raise SystemExit(code)


def run_lock(out: Path, check_ranks: bool = True) -> contextlib.ExitStack:
    """The run's lock, `OUT/.lock`, for the launcher or the single process (`check_ranks`: and no rank of
    an earlier run left); one line naming --out if another process holds either."""
    from glm5.infra.fsio import one_writer

    stack = one_writer(out, Path(out) / ".lock")
    if check_ranks:
        try:
            check_no_ranks(out)
        except fsio.OutputBusy as exc:
            stack.close()
            raise click.BadParameter(str(exc), param_hint="'--out'") from None
    return stack


#: exit code of a rank whose collective failed because another rank is gone (it prints nothing: the
#: launcher names the rank that died)
PEER_LOST = 3


def _peer_lost(exc: BaseException) -> bool:
    """A collective that failed because a peer process is gone (gloo: 'Connection reset/closed by peer')."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and "gloo" in text and ("peer" in text or "Connection" in text)
    )


@contextlib.contextmanager
def on_interrupt(out: Path, rank: bool = False):
    """Ctrl-C inside: the one line of `interrupted` and exit 130. In a rank (`rank`), no line (its launcher
    says it): exit 130, or PEER_LOST when a collective failed because another rank died."""
    try:
        yield
    except KeyboardInterrupt:
        if rank:
            raise SystemExit(128 + signal.SIGINT) from None
        raise interrupted(out) from None
    except RuntimeError as exc:
        if rank and _peer_lost(exc):
            raise SystemExit(PEER_LOST) from None
        raise


def quiet_agent() -> None:
    """torch elastic's agent logs each rank it stops and each failure in several lines; the launcher says
    it in one (rank_failure, interrupted)."""
    import logging

    import torch.distributed.launcher.api  # noqa: F401 - creates the agent's loggers

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
