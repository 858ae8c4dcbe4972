"""The watchdog's CUDA path on one GPU (part of examples/gpu/check.sh): what one GPU can prove.

1. `Guard.sync` polls a real CUDA event behind a long-running kernel (`torch.cuda._sleep`): while the kernel
   runs the host is not blocked in the driver, and a fault reported by a peer ends the wait with the peer's
   line within a poll, long before the kernel ends.
2. A one-rank NCCL communicator of a refit group (`refit_group(..., device="cuda")`) carries a collective
   through the guarded path (`all_gather_object`, whose size read synchronizes under the guard); then, with a
   long kernel queued ahead of its next collective, a fault aborts the communicator from the guard: control
   returns, and the process can still use the GPU.

Prints one JSON line per check; exits non-zero when a check fails.
"""
from __future__ import annotations

import json
import sys
import threading
import time

import torch
import torch.distributed as dist

from reshard_cli.base.ports import free_port
from reshard_cli.transfer.comm import refit_group
from reshard_cli.transfer.watchdog import Fault, GroupBroken, Guard, Watchdog


def _cycles(seconds: float) -> int:
    """GPU clock cycles for about `seconds` of `torch.cuda._sleep` (measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * seconds * 1000 / max(start.elapsed_time(end), 1e-3))


def poll_check(cycles_per_s: int) -> dict:
    store = dist.TCPStore("127.0.0.1", free_port(), 2, is_master=True, wait_for_workers=False)
    me, peer = Watchdog(store, 0, 2), Watchdog(store, 1, 2)
    guard = Guard(me)
    event = torch.cuda.Event()
    torch.cuda._sleep(cycles_per_s * 1)  # a 1 s kernel: the guarded wait sees it end
    event.record()
    t0 = time.perf_counter()
    guard.sync(event, what="a 1 s kernel")
    finished = time.perf_counter() - t0
    torch.cuda._sleep(cycles_per_s * 20)  # a 20 s kernel, as one blocked on a dead peer would be
    event = torch.cuda.Event()
    event.record()
    threading.Timer(1.0, peer.report, args=(Fault("refit rank 1 (trainer 1): simulated death", (1,)),)).start()
    t0 = time.perf_counter()
    try:
        guard.sync(event, what="a 20 s kernel")
        named, line = None, None
    except GroupBroken as e:
        named, line = time.perf_counter() - t0, str(e)
    torch.cuda.synchronize()
    guard.close()
    peer.close()
    return {"check": "guard polls a CUDA event", "kernel_1s_waited_s": round(finished, 3),
            "kernel_20s_fault_named_after_s": None if named is None else round(named, 3), "line": line,
            "ok": 0.9 < finished < 3 and named is not None and named < 3}


def nccl_abort_check(cycles_per_s: int) -> dict:
    group = refit_group("127.0.0.1", free_port(), 0, 1, timeout=60, device="cuda")
    got = group.all_gather_object({"rank": 0}, what="check")  # NCCL, synchronized under the guard
    torch.cuda._sleep(cycles_per_s * 20)  # a 20 s kernel ahead of the next collective
    flag = torch.ones(1, device="cuda")
    work = group.pg.allreduce([flag])
    group.wait(work)  # orders the stream only: returns at once
    event = torch.cuda.Event()
    event.record()
    threading.Timer(1.0, group.guard.watchdog.report, args=(Fault("refit rank 0: simulated fault", (0,)),)).start()
    t0 = time.perf_counter()
    try:
        group.guard.sync(event, what="a collective behind a 20 s kernel")
        returned, line = None, None
    except GroupBroken as e:
        returned, line = time.perf_counter() - t0, str(e)
    group.close()
    alive = float(torch.ones(4, device="cuda").sum().item()) == 4.0  # the process still uses the GPU
    return {"check": "NCCL communicator aborted from the guard", "gathered": got,
            "control_returned_after_s": None if returned is None else round(returned, 3), "line": line,
            "gpu_usable_after": alive, "ok": returned is not None and returned < 5 and alive}


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"check": "cuda", "ok": False, "why": "no CUDA device"}))
        return 1
    per_s = _cycles(1.0)
    results = [poll_check(per_s), nccl_abort_check(per_s)]
    for r in results:
        print(json.dumps(r))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
