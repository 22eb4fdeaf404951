"""Run a function on N gloo ranks on 127.0.0.1 (one thread each) and collect what each returns.

    results = run_ranks(fn, 2, arg)   # fn(rank, world, arg) -> picklable, run in rank order

`fn` must be importable (a module-level function of a test module). Each rank gets a process of its own,
so a failure in one rank is raised here with its traceback instead of hanging the others. The processes
fork from one forkserver that imported torch and its distributed packages once (a spawned rank spends
about 2 s of CPU importing them; the suite starts some hundred ranks); while a test has changed the
environment since that server started, its ranks are spawned instead, so that they read it fresh. The
rendezvous store is this process's, on a port it keeps bound, so concurrent runs (tox's parallel mode) never
pick the same port.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from queue import Empty as queue_empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: imported once by the forkserver; nothing of this project (its modules read the environment at import)
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch._dynamo",
]
_server_env: dict[str, str] | None = None


def _context():
    global _server_env
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    if _server_env is None:
        _server_env = env
        mp.set_forkserver_preload(_PRELOAD)
    return mp.get_context("forkserver" if env == _server_env else "spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )  # what torchrun sets: DeviceMesh and FSDP2 read them
    torch.set_num_threads(1)
    try:
        # the parent holds the store's port (run_ranks): rank 0 connects to it rather than binding it
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            # plain pickle bytes: a tensor sent through the queue as shared memory dies with this process
            queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """fn(rank, world, *args) on `world` gloo processes -> the results in rank order."""
    ctx = _context()
    queue = ctx.Queue()
    # the rendezvous store lives here, on a port the OS picked and this process keeps bound until the ranks
    # are done: no window in which another process (a concurrent tox env, a vLLM engine) can take it
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, fn, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in range(world):
        try:
            rank, status, value = queue.get(timeout=timeout)
        except queue_empty:
            errors.append(f"no result within {timeout} s (exit codes {[p.exitcode for p in procs]})")
            break
        if status == "ok":
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank}:\n{value}")
            break
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
