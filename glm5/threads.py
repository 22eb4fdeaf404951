"""How many intra-op threads torch runs on the CPU for each `glm5` command (issue 21).

OpenMP ends every parallel region by waiting for all of its threads; on a small machine shared with other
work one thread is often descheduled, so code made of many small ops waits far more than it computes:
the conformance suite ran 4-6x slower with torch's default (every core) than with one thread on a loaded
2-core machine. Commands made of many small ops therefore run one intra-op thread (COMMAND_THREADS); the
others keep torch's default, and the cpu backend's big ops spread whole blocks over that many threads
themselves (backends/cpu/_parallel.py). A thread count the user set (OMP_NUM_THREADS or MKL_NUM_THREADS,
which torch reads at start-up, or an explicit --threads) always wins.

No torch import here: `glm5 --help` and `glm5 doctor` stay fast.
"""

from __future__ import annotations

import os
import sys

#: the environment variables through which a user sets torch's intra-op thread count
USER_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: intra-op threads of commands made of many small ops (conformance: thousands of small cases; train:
#: the tiny presets' steps); the commands not listed keep torch's default
COMMAND_THREADS: dict[str, int] = {"conformance": 1, "train": 1}


def user_set() -> bool:
    """Whether the user chose a thread count through the environment."""
    return any(os.environ.get(name, "").strip() for name in USER_ENV)


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def command_threads(command: str | None, requested: int | None = None) -> int | None:
    """Intra-op threads for `command`: `requested` (a --threads option, 0 = every core) if given; else None
    (leave torch's count alone) if the user set OMP_NUM_THREADS / MKL_NUM_THREADS; else the command's
    entry in COMMAND_THREADS (None for a command not listed: torch's default)."""
    if requested is not None:
        return requested or cores()
    if user_set():
        return None
    return COMMAND_THREADS.get(command or "")


def apply_command_threads(command: str | None) -> int | None:
    """Set the policy's thread count for `command` (the `glm5` group runs this before the command);
    returns the count set, or None when torch's own count stands."""
    n = command_threads(command)
    if n is None:
        return None
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(n)
    else:  # torch reads it when it loads OpenMP and MKL: no torch import (seconds) for `--help`
        os.environ["OMP_NUM_THREADS"] = str(n)
    return n
