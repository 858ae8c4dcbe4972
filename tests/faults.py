"""Test-only entry point: `reshard run` with faults injected through the worker's hooks.

    python tests/faults.py FAULTS run --src A --dst B ...     (the arguments of `reshard run`)

FAULTS is a comma list of KIND:RANK. `die` makes that rank exit before moving anything, `stall:RANK:SECONDS`
stops it (SIGSTOP) that long before moving anything (then it continues); the others damage
one destination shard of that rank after the transfer, so a test can prove that verification catches it:
corrupt (one flipped byte), missing (an element left as the sentinel), misplaced (two elements swapped),
duplicated (one element copied over another). The launcher starts this same file in every worker, which hands
the hooks to `reshard run` through the CLI's context object; nothing of this is in the production worker.
"""
import os
import signal
import subprocess
import sys

import torch

from reshard_cli import cli
from reshard_cli.transfer import launcher, run
from reshard_cli.transfer.shards import SENTINEL_BYTE


class Faults(run.Hooks):
    def __init__(self, spec: str):
        self.faults = [tuple(x.split(":", 1)) for x in spec.split(",") if x]

    def before_transfer(self, rank: int) -> None:
        if ("die", str(rank)) in self.faults:
            os._exit(17)
        for kind, target in self.faults:  # stall:RANK:SECONDS - stopped (SIGSTOP) that long, then continued
            if kind == "stall" and target.split(":")[0] == str(rank):
                seconds = target.split(":")[1]
                # a session of its own: torchrun's stop of the worker's process group must not end it (a
                # stopped worker that never continues is SIGKILLed by torchrun 30 s after its SIGTERM)
                subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True)
                os.kill(os.getpid(), signal.SIGSTOP)

    def after_transfer(self, rank: int, dst_shards: dict) -> None:
        for kind, target in self.faults:
            if kind not in ("die", "stall") and target == str(rank):
                damage(kind, dst_shards)


def damage(kind: str, dst_shards: dict) -> None:
    t = max(dst_shards, key=lambda k: dst_shards[k].data.numel())
    x = dst_shards[t].data.reshape(-1)
    if kind == "corrupt":
        x.view(torch.uint8)[1] ^= 0x10
    elif kind == "missing":
        x[3:4].view(torch.uint8).fill_(SENTINEL_BYTE)
    elif kind in ("misplaced", "duplicated"):
        j = next(j for j in range(1, x.numel()) if not torch.equal(x[j:j + 1], x[0:1]))
        a, b = x[0:1].clone(), x[j:j + 1].clone()
        x[0:1] = b
        if kind == "misplaced":
            x[j:j + 1] = a
    else:
        raise ValueError(f"unknown fault {kind!r}")


if __name__ == "__main__":
    spec = sys.argv.pop(1)
    launcher.ENTRY = [os.path.abspath(__file__), spec]  # every worker runs this file with the same faults
    sys.argv[0] = "reshard"
    cli.main(obj={"hooks": Faults(spec)})
