"""Who carries the bytes: the job's default process group, or a refit group of its own.

A refit often runs between processes that already belong to other worlds: an inference engine owns its
workers' default process group, a trainer its own. Such a refit joins a separate group — `refit_group()`
makes one over a TCP rendezvous without touching torch.distributed's global state — and the engine, the
verification and the live API talk through a `Comm`:

    WorldComm()            the default process group (torchrun jobs, `reshard run`, `reshard bench`)
    GroupComm(pg)          a stand-alone ProcessGroup, and sub-groups of it made over its own store

Ranks are always the refit's ranks (the ones the layouts name). The broadcast path's sub-groups (one per
root) are made the same way on both: collectively, in the same order on every rank; over a `GroupComm` each is
a stand-alone ProcessGroup of its members only, rendezvoused on the refit group's store under a prefix of its
own, so no global state of torch.distributed is touched.
"""
from __future__ import annotations

import pickle
import time
from functools import partial
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from reshard_cli.errors import ConfigError, RuntimeFailure
from reshard_cli.transfer.watchdog import Fault, GroupBroken, Guard, Watchdog

STALL = 30.0  # seconds without a heartbeat after which a refit group's peer is named as stalled (at most; half
# the group's timeout when that is shorter, so the watchdog speaks before the transport times out)


class _Comm:
    """What both comms share: an optional `guard` (`transfer.watchdog.Guard`) whose watchdog ends every wait
    on the group's traffic as soon as any rank reports a fault or stops answering, with a line naming that
    rank (`GroupBroken`), instead of at the timeout."""

    guard: Guard | None = None

    def run(self, fn, *args):
        """A blocking call on the group (a wait, a collective), guarded when the group has a watchdog."""
        return fn(*args) if self.guard is None else self.guard.run(fn, *args)

    def _work(self, op, *args) -> "_Work":
        return _Work(self, op(*args) if self.guard is None else self.guard.post(op, *args))

    def wait(self, work) -> None:
        self.run(work.wait)

    def fail(self, line: str, ranks: tuple = ()):
        """Give the group up with `line` (told to every other rank first, with a watchdog); raises GroupBroken."""
        if self.guard is None:
            raise GroupBroken(line, ranks)
        self.guard.fail(Fault(line, tuple(ranks)))

    def name_ranks(self, roles: list[str]) -> None:
        """What each rank is ("trainer 0", "vLLM worker 1"), for the watchdog's lines."""
        if self.guard is not None:
            self.guard.watchdog.roles = list(roles)


class WorldComm(_Comm):
    """The default process group (guarded while `reshard run`'s launcher holds the job: `watch`)."""

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    def isend(self, t: torch.Tensor, peer: int):
        return self._work(dist.isend, t, peer)

    def irecv(self, t: torch.Tensor, peer: int):
        return self._work(dist.irecv, t, peer)

    def new_group(self, ranks: list[int]):
        return dist.new_group(ranks)

    def broadcast(self, t: torch.Tensor, root: int, group) -> None:
        self.run(partial(dist.broadcast, t, src=root, group=group))

    def barrier(self) -> None:
        self.run(dist.barrier)

    def all_gather_object(self, obj) -> list:
        out: list = [None] * self.size
        self.run(dist.all_gather_object, out, obj)
        return out

    def all_reduce_max(self, t: torch.Tensor) -> None:
        self.run(partial(dist.all_reduce, t, op=dist.ReduceOp.MAX))

    def watch(self, guard: Guard | None) -> None:
        """Guard the default group's waits with `guard` (None: stop)."""
        if self.guard is not None and guard is None:
            self.guard.close()
        self.guard = guard


class GroupComm(_Comm):
    """A stand-alone ProcessGroup (not registered with torch.distributed), for example from `refit_group`."""

    def __init__(self, pg, rank: int, size: int, device: torch.device | str = "cpu", guard: Guard | None = None,
                 store=None, timeout: float = 300.0):
        self.pg, self._rank, self._size = pg, rank, size
        self.device = torch.device(device)  # where the group's own small tensors live (cuda for NCCL)
        self.guard = guard
        self._store, self.timeout = store, timeout  # the store sub-groups rendezvous on
        self._subgroups: dict[tuple, SubGroup | None] = {}  # member ranks -> this rank's sub-group (None: not in it)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def isend(self, t: torch.Tensor, peer: int):
        return self._work(self.pg.send, [t], peer, 0)

    def irecv(self, t: torch.Tensor, peer: int):
        return self._work(self.pg.recv, [t], peer, 0)

    def close(self) -> None:
        """Stop the heartbeat (the group is not used again)."""
        if self.guard is not None:
            self.guard.close()

    def new_group(self, ranks: list[int]) -> "SubGroup | None":
        """A sub-group of `ranks` (refit ranks). Collective in the torch.distributed sense: every rank calls it
        with the same ranks in the same order (only members connect); the same ranks again give the same group.
        None on a rank outside it."""
        members = tuple(sorted(set(ranks)))
        if members in self._subgroups:
            return self._subgroups[members]
        if self._store is None:
            raise ConfigError("this refit group has no store to make sub-groups on (make it with refit_group)",
                              key="group")
        prefix = f"reshard-sub/{len(self._subgroups)}"  # the same on every rank: the same calls in the same order
        sub = None
        if self._rank in members:
            store = dist.PrefixStore(prefix, self._store)
            sub = SubGroup(self.run(self._make_pg, store, members.index(self._rank), len(members)), members)
        self._subgroups[members] = sub
        return sub

    def _make_pg(self, store, rank: int, size: int):
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=self.timeout)
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=self.timeout))

    def broadcast(self, t: torch.Tensor, root: int, group: "SubGroup") -> None:
        """`t` from refit rank `root` to every member of `group` (a `new_group`)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = group.ranks.index(root), 0
        self.wait(group.pg.broadcast([t], opts))

    def barrier(self) -> None:
        flag = torch.zeros(1, device=self.device)
        self.wait(self.pg.allreduce([flag]))

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj` (pickled, as torch's own all_gather_object does, between this job's processes)."""
        dev = self.device
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self._size)]
        self.wait(self.pg.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.int64, device=dev)]))
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
        padded[:data.numel()] = data.to(dev)
        outs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(self._size)]
        self.wait(self.pg.allgather([outs], [padded]))
        return [pickle.loads(o[:int(s.item())].cpu().numpy().tobytes()) for o, s in zip(outs, sizes)]  # noqa: S301

    def all_reduce_max(self, t: torch.Tensor) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        moved = t.to(self.device)
        self.wait(self.pg.allreduce([moved], opts))
        if moved is not t:
            t.copy_(moved)


class SubGroup:
    """A sub-group of a refit group: its ProcessGroup (ranks 0..n-1) and the refit ranks of its members."""

    def __init__(self, pg, ranks: tuple):
        self.pg, self.ranks = pg, ranks


class _Work:
    """A message of a comm, whose wait the comm's watchdog can end."""

    def __init__(self, comm: _Comm, work):
        self.comm, self.work = comm, work

    def wait(self) -> None:
        self.comm.wait(self.work)


def refit_group(host: str, port: int, rank: int, size: int, *, timeout: float = 300.0,
                device: torch.device | str = "cpu", abort: Callable[[], str | None] | None = None,
                stall: float | None = None, names: Callable[[int], str] | None = None) -> GroupComm:
    """Join (rank 0: host) a group of `size` processes over a TCP store at host:port, leaving torch.distributed's
    default group, if any, untouched: gloo for CPU tensors, NCCL when `device` is a CUDA device (every rank of
    one group must pass the same kind).

    Every rank first checks in and waits for the others, polling `abort` (a reason to give up, or None): a
    peer that will never come (an engine that refused the init call) ends the wait on every rank that
    checked in, with that reason, instead of a timeout. `names`: what each rank is ("vLLM replica 1 worker 0"),
    for the line that names the ranks that never came."""
    device = torch.device(device)
    try:
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
    except (dist.DistStoreError, RuntimeError) as e:  # a port in use, or no rank 0 listening in time
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "could not listen on" if rank == 0 else "could not reach rank 0's store at"
        raise RuntimeFailure(f"refit group: rank {rank} {where} {host}:{port} within {timeout:.0f} s "
                             f"({first})") from None
    prefixed = dist.PrefixStore("reshard-refit", store)
    watchdog = Watchdog(store, rank, size, stall=min(timeout / 2, STALL) if stall is None else stall)
    try:
        _check_in(prefixed, rank, size, timeout, abort, names)
    except dist.DistError as e:  # rank 0 left (an abort whose reason came too late here), or its host died
        raise RuntimeFailure(f"refit group: rank 0's store at {host}:{port} went away while rank {rank} was "
                             f"joining ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
                             f"; the group was given up") from None
    comm = GroupComm(None, rank, size, device if device.type == "cuda" else "cpu",
                     guard=Guard(watchdog, device if device.type == "cuda" else None), store=store, timeout=timeout)
    comm.pg = comm._make_pg(prefixed, rank, size)  # the store (on rank 0, its server) lives as long as the group
    watchdog.start()
    return comm


ABORT_GRACE = 10.0  # seconds rank 0 keeps its store up after an abort, for peers still on their way to read it


def abort_group(host: str, port: int, reason: str, *, rank: int | None = None, timeout: float = 60.0) -> None:
    """Tell every process joining the refit group at host:port that it will not form, and why: from a process
    that cannot join it (an engine worker that is not the layout's; `rank` when it has one). Nobody listening
    within `timeout`: nobody to tell."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
        prefixed = dist.PrefixStore("reshard-refit", store)
        prefixed.set("abort", reason)
        if rank is not None:
            prefixed.set(f"seen/{rank}", "1")
    except (dist.DistError, RuntimeError):
        pass


def _check_in(store, rank: int, size: int, timeout: float, abort, names=None) -> None:
    store.set(f"in/{rank}", "1")
    deadline = time.monotonic() + timeout
    while True:
        reason = store.get("abort").decode() if store.check(["abort"]) else None
        if reason is None and abort is not None and (reason := abort()):
            store.set("abort", reason)
        if reason:
            _abandon(store, rank, size, min(timeout, ABORT_GRACE))
            raise RuntimeFailure(f"refit group: {reason}")
        if store.check([f"in/{r}" for r in range(size)]):
            return
        if time.monotonic() > deadline:
            missing = [r for r in range(size) if not store.check([f"in/{r}"])]
            who = ", ".join(f"{r} ({names(r)})" for r in missing) if names else ", ".join(map(str, missing))
            raise RuntimeFailure(f"refit group: rank(s) {who} did not join within {timeout:.0f} s")
        time.sleep(0.05)


def _abandon(store, rank: int, size: int, grace: float) -> None:
    """Leave a check-in that was aborted. Rank 0 serves the store: it stays until every peer has read the
    reason (or `grace` seconds), so a peer that connects late learns it instead of waiting for a store that is
    gone."""
    store.set(f"seen/{rank}", "1")
    if rank != 0:
        return
    until = time.monotonic() + grace
    while time.monotonic() < until and not store.check([f"seen/{r}" for r in range(size)]):
        time.sleep(0.05)


WORLD = WorldComm()
