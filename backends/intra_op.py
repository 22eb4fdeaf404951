"""torch's intra-op thread count, pinned for a block of code.

A BLAS may split a GEMM differently for another thread count, and then sums in another order; a result
that must be the same bits whatever the caller's thread count (the indexers' scores, which the cpu
backend reproduces by calling the reference's own function, docs/spec.md 4.1) is computed on one thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """torch runs one intra-op thread inside the block; the caller's count is restored after it."""
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)
