"""Independent blocks of an op spread over Python threads, each block on one intra-op thread (issue 21).

torch's own parallelism splits every op of a block (gather, GEMMs, each softmax step) into its own OpenMP
region, and each region waits at its end for all of its threads: on a machine shared with other work a
descheduled thread holds up every region, and the attention prefill (about 20 regions per query block)
ran 3-6x slower on two threads than on one. Here the threads take whole blocks off a shared iterator
instead (dynamic scheduling, one join per op), so a descheduled thread delays only the block it holds.
Every block runs torch's single-threaded kernels: the results are the bits of a one-thread run, whatever
the thread count or the load.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from backends.intra_op import one_thread

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_key: tuple[int, int] = (0, 0)  # (pid, workers): a forked child or a larger count gets a new pool
_busy = threading.Lock()  # one op at a time spreads over the pool; a concurrent caller runs inline
_END = object()


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_key
    pid = os.getpid()
    if _pool is None or _pool_key[0] != pid or _pool_key[1] < workers:
        if _pool is not None and _pool_key[0] == pid:
            _pool.shutdown(wait=False)
        _pool, _pool_key = ThreadPoolExecutor(workers, thread_name_prefix="glm5-cpu"), (pid, workers)
    return _pool


def _drain(blocks: Iterator[T], fn: Callable[[T], object], lock: threading.Lock, errors: list, modes) -> None:
    """Take blocks off the shared iterator until it ends or a block failed, in the caller's grad and
    inference modes (both thread-local: a custom op's forward runs without autograd, and a block may write
    into inference tensors)."""
    if torch.get_num_threads() != 1:  # a pool thread keeps this for good
        torch.set_num_threads(1)
    grad, inference = modes
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        _take(blocks, fn, lock, errors)


def _take(blocks: Iterator[T], fn: Callable[[T], object], lock: threading.Lock, errors: list) -> None:
    while True:
        try:
            with lock:
                if errors:
                    return
                block = next(blocks, _END)
            if block is _END:
                return
            fn(block)
        except BaseException as exc:  # re-raised by the caller
            with lock:
                errors.append(exc)
            return


def run_blocks(fn: Callable[[T], object], blocks: Iterable[T], threads: int | None = None) -> None:
    """fn(block) for every block, each on one intra-op thread, spread over `threads` Python threads (the
    caller's included; default: torch's intra-op thread count, so OMP_NUM_THREADS / set_num_threads
    still decide how many cores an op uses). fn must write only its own block's outputs."""
    n = torch.get_num_threads() if threads is None else threads
    with one_thread():
        if n <= 1 or not _busy.acquire(blocking=False):
            for block in blocks:
                fn(block)
            return
        try:
            it, lock, errors = iter(blocks), threading.Lock(), []
            pool = _executor(n - 1)
            modes = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
            futures = [pool.submit(_drain, it, fn, lock, errors, modes) for _ in range(n - 1)]
            _take(it, fn, lock, errors)
            for f in futures:
                f.result()
        finally:
            _busy.release()
    if errors:
        raise errors[0]
