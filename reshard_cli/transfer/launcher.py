"""One way to start and join a torchrun job, shared by `reshard run`, `reshard bench` and `reshard topo`.

Not under torchrun: `launch()` runs torchrun (`--standalone`) in this process with as many workers as the
command needs, each running this same command line; torchrun's agent forwards Ctrl-C/SIGTERM to the workers
and stops them all when one fails, and the failure becomes one line naming the rank.

Under torchrun (RANK/WORLD_SIZE set), a command is a worker: `prepare()` validates its input on every rank
(rank 0 prints the one-line error; the others leave it time to, and torchrun stops them), `process_group()`
joins the job, and `all_ok()` turns a failure on any rank into one error that names each failed rank.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from reshard_cli.errors import ConfigError, ReshardError, RuntimeFailure
from reshard_cli.transfer.agree import gather_failures, one_line
from reshard_cli.transfer.shm import usable
from reshard_cli.transfer.comm import STALL, WORLD, world_guard
from reshard_cli.transfer.watchdog import GroupBroken, Guard

T = TypeVar("T")

# What the workers run: this package's CLI with the same arguments. Tests that need another entry (to install
# hooks in every worker) set it to their own script.
ENTRY: list[str] = ["-m", "reshard_cli"]


@dataclass(kw_only=True)
class JobOptions:
    """What every command that runs as a torchrun job takes (`reshard run`, `reshard bench`)."""

    topology: Path | None = None
    reshard_match: str | None = None
    backend: str = "auto"
    transport: str = "auto"  # what carries the messages (`transfer.shm.with_transport`): auto, gloo, nccl, shm
    bucket_mb: float = 64.0
    scale: int = 1
    quiet: bool = False
    timeout: float = 300.0
    argv: list = field(default_factory=list)  # the command line, run again by every worker


class Reported(ReshardError):
    """An error another process prints (worker rank 0, or the worker itself for the launcher): exit with its
    code without printing it again."""

    quiet = True

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class RankFailure(ReshardError):
    """Printed by rank 0: what failed on which ranks."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(world: int, argv: list[str]) -> None:
    """Run torchrun with `world` local workers, each running `ENTRY + argv`; raise on the first failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # workers print their own errors
    args = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(world), *ENTRY, *argv])
    try:
        torchrun(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode in (1, 2):  # our own exit: the worker already printed its one-line error
            raise Reported(f"worker rank {rank} failed", failure.exitcode) from None
        raise RuntimeFailure(f"worker rank {rank} died (exit code {failure.exitcode}); "
                             f"the other workers were stopped") from None


def rank_and_world() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


REPORT_GRACE = 20.0  # seconds a rank whose validation failed leaves rank 0 to say the same, before it does


def prepare(fn: Callable[[], T]) -> T:
    """Run a worker's validation (the same on every rank, before the process group exists): rank 0 raises
    the error for the user. Another rank that fails waits for rank 0 to fail the same way (torchrun then stops
    it); exiting at once, it could be the failure torchrun acts on first and stop rank 0 before its line is
    out (a loaded host). Where rank 0 has not failed within `REPORT_GRACE` seconds (the check differs there:
    a file only some hosts have), the rank raises its own line."""
    try:
        return fn()
    except ReshardError:
        if rank_and_world()[0] == 0:
            raise
        time.sleep(REPORT_GRACE)
        raise


def check_world(world: int, needed: int, what: str) -> None:
    if world < needed:
        raise ConfigError(f"world size {world} is smaller than the {needed} ranks {what}", key="WORLD_SIZE")


def pick_backend(choice: str, transport: str = "auto") -> str:
    """auto: nccl when every local rank has a GPU, else gloo; nccl without enough GPUs is a one-line error.
    `transport` (`--transport`): gloo or nccl name the backend too; shm runs on gloo (host memory)."""
    if choice not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"unknown backend {choice!r} (auto, gloo, nccl)", key="--backend")
    if transport not in ("auto", "gloo", "nccl", "shm"):
        raise ConfigError(f"unknown transport {transport!r} (auto, gloo, nccl, shm)", key="--transport")
    if transport == "shm" and (why := usable()):
        raise ConfigError(why, key="--transport")
    wants = {"shm": "gloo"}.get(transport, transport)
    if wants != "auto":
        if choice not in ("auto", wants):
            raise ConfigError(f"--transport {transport} runs on the {wants} backend, not {choice}", key="--transport")
        choice = wants
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "nccl" and gpus < local:
        raise ConfigError(f"nccl needs one GPU per local rank: {local} ranks on this node, {gpus} GPUs",
                          key="--backend")
    if choice != "auto":
        return choice
    return "nccl" if gpus >= local else "gloo"


@contextmanager
def process_group(backend: str, timeout: float) -> Iterator[torch.device]:
    """Join the job's process group for the block; yields the device this rank works on (its GPU under nccl)."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    WORLD.watch(_guard(device, timeout))
    try:
        yield device
    except GroupBroken as e:  # a rank failed, died or stalled: its line, from one rank; gloo is not torn down
        raise _named(e) from None  # (a helper thread may still be in it); the process leaves with os._exit
    except ReshardError as e:
        if e.exit_code != 2:
            dist.destroy_process_group()
        raise  # bad input every rank agreed on: `leave` ends the process, gloo is not torn down
    except BaseException:
        dist.destroy_process_group()
        raise
    else:
        dist.destroy_process_group()
    finally:
        WORLD.watch(None)


def _guard(device: torch.device, timeout: float) -> Guard:
    """The job's watchdog (`transfer.watchdog`) over torchrun's own store: heartbeats, fault lines, and the
    default group's waits ended by them. Every rank's heartbeat key exists once the barrier is passed."""
    guard = world_guard(device, stall=min(timeout / 2, STALL), label="rank")
    dist.barrier()
    guard.watchdog.start()
    return guard


def _named(e: GroupBroken) -> ReshardError:
    """One rank says it: the lowest rank the line does not name (it may be rank 0 that stalled)."""
    alive = [r for r in range(dist.get_world_size()) if r not in e.ranks]
    printer = alive[0] if alive else 0
    if dist.get_rank() == printer:
        out = RankFailure(str(e), 1)
    else:
        out = Reported(str(e), 1)
    out.group_broken = True
    return out


_PRINTED = "reshard/error-printed"  # set by the worker that printed the job's one-line error


def leave(code: int, printer: bool) -> None:
    """A torchrun worker's exit (with `code`) after an error one worker prints: bad input every rank agreed on
    (2), or a broken group's line (1, `_named`). Tearing gloo down while the peers leave too can abort in C++
    ("terminate called without an active exception") and add a line the user should not see, and a broken
    group may still have a thread inside gloo, so no worker tears it down: each leaves with os._exit. The worker
    that printed the line says so on the job's store first, and the quiet ones wait for that (at most 10 s), so
    torchrun, which stops every worker when one exits, never stops the printer before its line is out."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=10))
        if printer:
            store.set(_PRINTED, "1")
        else:
            store.wait([_PRINTED], timedelta(seconds=10))
    except Exception:  # noqa: BLE001 - no store (it left with its host), or no line within 10 s: leave anyway
        pass
    os._exit(code)


def all_ok(stage: str, error: BaseException | None) -> None:
    """Collective: if any rank failed `stage`, every rank raises one error naming each failed rank."""
    failed = gather_failures(_all_gather, None if error is None else f"{error}",
                             exit_code=getattr(error, "exit_code", 1))
    if failed:
        text, code = one_line(failed, stage=stage), max(f.exit_code for f in failed)
        raise RankFailure(text, code) if dist.get_rank() == 0 else Reported(text, code)


def _all_gather(obj) -> list:
    """Every rank's `obj` (the default group), in rank order."""
    return WORLD.all_gather_object(obj)


@contextmanager
def collected(stage: str) -> Iterator[None]:
    """Run a block on every rank, then `all_ok(stage, what it raised)`: one error naming every failed rank."""
    err: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - reported collectively
        if getattr(e, "group_broken", False):  # a peer failed, died or stalled, and the line names it: no
            # collective could complete with it, so one rank says it now and torchrun stops the others
            raise GroupBroken(str(e).removeprefix("reshard: "), getattr(e, "ranks", ())) from None
        err = e if isinstance(e, ReshardError) else RuntimeFailure(f"{e.__class__.__name__}: {e}")
    all_ok(stage, err)


def sync(device: torch.device) -> None:
    """Barrier after this rank's device work is done (timings between two syncs are the slowest rank's)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    WORLD.barrier()


def allreduce_int(n: int, op=dist.ReduceOp.MAX) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    WORLD.all_reduce(t, op)
    return int(t.item())
