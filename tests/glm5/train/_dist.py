"""The distributed training tests' spawner: tests/ranks.py's `run_ranks`, results dropped."""

from __future__ import annotations

from tests.ranks import free_port, run_ranks

__all__ = ["free_port", "spawn"]


def spawn(fn, world: int, *args) -> None:
    """fn(rank, world, *args) on `world` gloo processes (fn at module level: it is pickled by name); a
    failing rank raises here with its traceback."""
    run_ranks(fn, world, *args)
