"""A rank of a user's own job stopped in the middle of a refit over the default group: every other rank names it
within the stall limit, not at the group's timeout (gloo's default: 30 minutes).

A 4-process gloo job started as torchrun starts one (MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE; the job's store
served by the parent, as torchrun's agent serves it; the default group's timeout left at gloo's) refits the
bundled CPU demo (layouts/demo: a TP2/EP2 trainer on ranks 0-1 into a TP2 engine on ranks 2-3) with
`Refit(role=..., src=..., dst=..., stall=3)`, which keeps a watchdog of its own over the job's store. The first
refit runs whole; in the second, rank 2 stops itself (SIGSTOP) as its verification begins (`at="transfer"`: as
its move begins). The others are blocked on it, in the verification's collective of the default group (or in
messages to and from it), and each must end with one line naming rank 2.

    python examples/world_stall.py            # prints the result as JSON

`scenario()` returns {"named": the line, "named_seconds": seconds from the stop to the last other rank's line,
"stall_limit": the Refit's stall=, "stopped_rank": 2, "stopped_at": where it stopped, "lines": every other
rank's line}.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC, DST = ROOT / "layouts/demo/train.yaml", ROOT / "layouts/demo/infer.yaml"
WORLD_SIZE, STOPPED, STALL = 4, 2, 3.0
STEPS = {"verification": "_verify", "transfer": "_move"}  # where rank STOPPED stops: the Refit's step it enters
LIMIT = 120.0  # seconds the scenario waits for every other rank's line (a hang fails it)


def _tensors(rank: int):
    """This rank's tensors: its source shards, or its destination buffers (zeros; their values do not matter)."""
    import torch

    from reshard_cli.formats import load_pair

    src, dst = load_pair(SRC, DST)
    role = "src" if rank in src.ranks else "dst"
    layout = src if role == "src" else dst
    man = layout.manifest.tensors
    return role, {man[t].name: torch.zeros(box.sizes, dtype=getattr(torch, man[t].dtype))
                  for t, box in layout.held(rank)}


def _rank(rank: int, port: int, stall: float, at: str, queue, stopped_at) -> None:
    """One process of the job: two refits, rank STOPPED stopping itself in the second."""
    import signal
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      TORCHELASTIC_USE_AGENT_STORE="True")  # the parent serves the store, as torchrun's agent does
    try:
        import torch.distributed as dist

        from reshard_cli.errors import ReshardError
        from reshard_cli.transfer.live import Refit

        dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)  # gloo's default timeout: 30 min
        role, tensors = _tensors(rank)
        refit = Refit(role=role, src=str(SRC), dst=str(DST), stall=stall)
        refit(tensors, verify_checksums=True)
        if rank == STOPPED:
            step = STEPS[at]
            real = getattr(refit, step)

            def stopping(part):
                stopped_at.value = time.time()
                os.kill(os.getpid(), signal.SIGSTOP)
                return real(part)
            setattr(refit, step, stopping)
        try:
            refit(tensors, verify_checksums=True)
            out = ("finished", rank, time.time(), "")
        except ReshardError as e:
            out = ("named", rank, time.time(), str(e))
    except BaseException:  # noqa: BLE001 - handed to the parent
        out = ("error", rank, time.time(), traceback.format_exc())
    queue.put(out)
    queue.close()
    queue.join_thread()
    os._exit(0)  # a wait on the stopped rank is still blocked on a helper thread: leave without tearing gloo down


def scenario(stall: float = STALL, at: str = "verification") -> dict:
    """Run the job (15 to 35 s on two busy cores) and return what the other ranks raised. `at`: where rank 2
    stops ("verification": the others wait in a collective; "transfer": in messages)."""
    from datetime import timedelta

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from reshard_cli.base.ports import free_port

    ctx = mp.get_context("spawn")
    queue, stopped_at = ctx.Queue(), ctx.Value("d", 0.0)
    port = free_port("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=True, wait_for_workers=False,  # noqa: F841
                          timeout=timedelta(seconds=LIMIT))  # the job's store: up until every line is in
    procs = [ctx.Process(target=_rank, args=(r, port, stall, at, queue, stopped_at), daemon=True)
             for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    try:
        deadline = time.monotonic() + LIMIT
        while len(got) < WORLD_SIZE - 1:
            status, rank, when, text = queue.get(timeout=max(deadline - time.monotonic(), 1.0))
            if status == "error":
                raise RuntimeError(f"rank {rank} failed before the stall:\n{text}")
            got[rank] = (status, when, text)
    finally:
        for p in procs:  # the stopped rank is killed here (SIGKILL ends a stopped process)
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    lines = {r: text for r, (_status, _when, text) in sorted(got.items())}
    seconds = max(when for _status, when, _text in got.values()) - stopped_at.value
    return {"named": lines[min(lines)], "named_seconds": round(seconds, 2), "stall_limit": stall,
            "stopped_rank": STOPPED, "stopped_at": at, "lines": lines}


if __name__ == "__main__":
    print(json.dumps(scenario(), indent=1))
