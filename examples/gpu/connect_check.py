"""The transport's eager set-up under the watchdog, on NCCL, on one GPU (part of examples/gpu/check.sh).

A group's first collective and a pair's first message create NCCL communicators (a store get, then
ncclCommInitRank). reshard makes them up front, on the guard's helper thread while the caller polls the
watchdog (`Comm.connect`). One GPU holds only one-rank NCCL groups, so what can be checked here:

1. eager       a one-rank NCCL refit group (`refit_group(..., device="cuda")`): its communicator is made by the
               set-up step, on the helper thread (`reshard-wait-0`), and its first collective afterwards does
               not make one (its time against a fresh group's first collective, which does).
2. world       a one-rank NCCL default group with a watchdog (`world_guard`, a `WorldComm`): the comm runs on
               the GPU, a sub-group's communicator is made up front on the helper thread, and an object
               collective, a barrier and a reduction return.
3. dead peer   a two-rank NCCL group whose rank 1 never comes and never beats: rank 0's set-up blocks in
               ncclCommInitRank on the helper thread; the caller names rank 1 at the stall limit (3 s), aborts the
               communicators, and returns while that thread is still blocked.
4. stuck peer  the same, but rank 1 beats (alive) and never starts its set-up: named once the step has made no
               progress for the link limit (3 s).

Each check runs in a process of its own (a hang fails that check, not the others) and prints one JSON line;
the whole takes well under a minute. Exits non-zero when a check fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

LIMIT = 3.0  # the stall limit and the link limit of checks 3 and 4


def _record_link_threads() -> list:
    """Wrap the set-up step to record the threads it runs on."""
    from reshard_cli.transfer import comm as comm_mod

    threads: list = []
    real = comm_mod._link

    def recording(comm, links, step, device):
        threads.append(threading.current_thread().name)
        return real(comm, links, step, device)
    comm_mod._link = recording
    return threads


def _first_collective_ms(pg) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device="cuda")
    opts = dist.AllreduceOptions()
    t0 = time.perf_counter()
    pg.allreduce([t], opts).wait()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def eager() -> dict:
    import torch.distributed as dist
    from datetime import timedelta

    from reshard_cli.base.ports import free_port
    from reshard_cli.transfer.comm import refit_group

    threads = _record_link_threads()
    group = refit_group("127.0.0.1", free_port(), 0, 1, timeout=60, device="cuda")
    after_eager = _first_collective_ms(group.pg)
    group.close()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=60)
    fresh = dist.ProcessGroupNCCL(dist.PrefixStore("fresh", store), 0, 1, opts)
    lazy = _first_collective_ms(fresh)
    fresh.abort()
    return {"check": "eager set-up of a one-rank NCCL refit group", "set_up_threads": threads,
            "first_collective_ms_after_eager_set_up": round(after_eager, 2),
            "first_collective_ms_fresh_group": round(lazy, 2),
            "ok": threads == ["reshard-wait-0"] and after_eager < lazy}


def world() -> dict:
    import torch
    import torch.distributed as dist

    from reshard_cli.base.ports import free_port
    from reshard_cli.transfer.comm import WorldComm, world_guard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    threads = _record_link_threads()
    comm = WorldComm()
    comm.guard = world_guard(torch.device("cuda", 0), stall=LIMIT, label="rank", prefix="check/")
    comm.guard.watchdog.start()
    device = str(comm.device)
    sub = comm.new_group([0])
    got = comm.all_gather_object({"rank": 0}, what="check")
    comm.barrier()
    flag = torch.ones(1, device="cuda")
    comm.all_reduce_max(flag)
    comm.guard.close()
    del sub
    return {"check": "a guarded one-rank NCCL default group", "device": device, "set_up_threads": threads,
            "gathered": got, "reduced": float(flag.item()),
            "ok": device == "cuda:0" and threads == ["reshard-wait-0"] and got == [{"rank": 0}]
            and float(flag.item()) == 1.0}


def _never_comes(beating: bool) -> dict:
    """Rank 0 of a two-rank NCCL group whose rank 1 never sets up: silent (`beating` False) or alive."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    from reshard_cli.base.ports import free_port
    from reshard_cli.transfer.comm import GroupComm
    from reshard_cli.transfer.watchdog import GroupBroken, Guard, Watchdog

    store = dist.TCPStore("127.0.0.1", free_port(), 2, is_master=True, wait_for_workers=False)
    me = Watchdog(store, 0, 2, stall=LIMIT if not beating else 60.0)
    peer = Watchdog(store, 1, 2)  # rank 1's heartbeat key; it beats only when `beating`
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=120)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("reshard-refit", store), 0, 2, opts)  # no communicator yet
    cuda = torch.device("cuda", 0)
    comm = GroupComm(pg, 0, 2, cuda, guard=Guard(me, cuda), store=store, timeout=120)
    comm.link_limit = LIMIT if beating else 60.0  # a silent peer is the heartbeat's to name
    me.start()
    if beating:
        peer.start()
    t0 = time.perf_counter()
    try:
        comm.connect(groups=[((0, 1), pg)], tag="group")
        line, seconds = None, None
    except GroupBroken as e:
        line, seconds = str(e), time.perf_counter() - t0
    helper = comm.guard._helper_thread
    blocked = helper is not None and helper.is_alive()  # still in ncclCommInitRank: the caller did not wait
    usable = float(torch.ones(4, device="cuda").sum().item()) == 4.0
    want = ("refit rank 1: did not reach setting up its transport for the whole group within 3 s" if beating
            else "refit rank 1 stopped answering: no heartbeat for")
    return {"check": f"set-up with a rank that never comes ({'alive' if beating else 'silent'})", "line": line,
            "named_after_s": None if seconds is None else round(seconds, 2), "limit_s": LIMIT,
            "set_up_still_blocked_on_its_thread": blocked, "gpu_usable_after": usable,
            "ok": line is not None and line.startswith(want) and seconds < LIMIT + 5 and usable}


CHECKS = {"eager": eager, "world": world, "dead-peer": lambda: _never_comes(False),
          "stuck-peer": lambda: _never_comes(True)}


def _one(name: str) -> None:
    try:
        out = CHECKS[name]()
    except Exception as e:  # noqa: BLE001 - the check failed: its line says how
        out = {"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
    os._exit(0)  # a set-up thread may still be blocked in NCCL: leave without tearing it down


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"check": "cuda", "ok": False, "why": "no CUDA device"}))
        return 1
    ok = True
    for name in CHECKS:
        try:
            run = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, timeout=90)
            line = (run.stdout.strip().splitlines() or [""])[-1]
            result = json.loads(line) if line.startswith("{") else {"check": name, "ok": False,
                                                                      "error": (run.stderr or "no output")[-500:]}
        except subprocess.TimeoutExpired:
            result = {"check": name, "ok": False, "error": "hung for 90 s"}
        print(json.dumps(result), flush=True)
        ok &= bool(result.get("ok"))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _one(sys.argv[1])
    sys.exit(main())
