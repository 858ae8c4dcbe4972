"""Run a function on N gloo processes (CPU) and collect what each returns or raises."""
from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp

from reshard_cli.base.ports import free_port  # noqa: F401  (tests import it from here)


def shm_files() -> set:
    """reshard's files in /dev/shm now."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("reshard-shm-")} if os.path.isdir("/dev/shm") else set()


def shm_files_left(before: set) -> set:
    """reshard's files in /dev/shm made since `before` by a process that has ended: what a finished job left
    behind (`shm.sweep`'s test). A running process's files belong to a test running beside this one, on another
    worker; a name reshard does not make counts as left."""
    from reshard_cli.transfer.shm import _NAME, _alive  # reshard-shm-<group>-p<pid>-r<rank>-<kind><n>

    return {n for n in shm_files() - before if not ((m := _NAME.match(n)) and _alive(int(m.group(1))))}


def agreed_port() -> int:
    """A port for a rendezvous of its own (a refit group), inside `run_ranks`' ranks: picked free by rank 0 once
    the default group's connections hold their ports (one picked before them can be taken by one of them),
    told to every rank."""
    import torch.distributed as dist

    port = [free_port("127.0.0.1") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    return port[0]


def _entry(rank, world, port, fn, args, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        dist.destroy_process_group()
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(world: int, fn, *args, timeout: float = 120.0) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, out = queue.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{out}")
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results
