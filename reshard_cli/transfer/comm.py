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

With a watchdog (`guard`), every wait on the group's traffic is bounded by its stall limit, on both comms: on
CPU (gloo) it runs on the guard's helper thread while the caller polls (`Guard.run_aside`: gloo's wait on a
stopped peer ends only at the group's timeout, whatever is shut down); on CUDA (NCCL) it runs on the caller's
thread, where the monitor's abort ends it, and the host blocks only in a polled synchronize (`Guard.sync`).

The transport's set-up is made up front under the watchdog too (`connect`): a pair's first message and a
group's first collective create their communicators (NCCL: a store get, then ncclCommInitRank, on whichever
thread calls), so when a refit group forms, when a sub-group is made and when an engine is built (the pairs
its schedule uses) one tiny collective or message per group and pair runs on the helper thread, in one global
order (groups in the order they were made, then pairs by their lower rank), each step said on the group's
store first. A peer that dies or stalls meanwhile is named at the stall limit; a step that makes no progress
for `link_limit` seconds names the rank that holds it up (followed from rank to rank on the store).
"""
from __future__ import annotations

import gc
import pickle
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from reshard_cli.errors import ConfigError, RuntimeFailure
from reshard_cli.transfer.rendezvous import (abort_group, check_in, connect_store,  # noqa: F401
                                             release_aside, world_guard)  # (abort_group, world_guard: re-exported)
from reshard_cli.transfer.watchdog import Fault, GroupBroken, Guard, Watchdog, _end

STALL = 10.0  # seconds without a heartbeat after which a refit group's peer is named as stalled (at most; half
# the group's timeout when that is shorter, so the watchdog speaks before the transport times out); heartbeats
# come every second on a store client of their own, so a busy rank still beats
LINK_LIMIT = 120.0  # seconds one step of setting up the transport may go without progress over the default group
# before the rank holding it up is named (a refit group: half its timeout); a dead or stopped peer: the stall limit
CPU = torch.device("cpu")


class _Comm:
    """What both comms share: an optional `guard` (`transfer.watchdog.Guard`) whose watchdog ends every wait
    on the group's traffic as soon as any rank reports a fault or stops answering, with a line naming that
    rank (`GroupBroken`), instead of at the timeout."""

    guard: Guard | None = None
    device = CPU  # where the group's collectives run (cuda: NCCL)
    link_limit = LINK_LIMIT  # see `connect`
    _links = 0  # engine set-ups linked so far (collective: the same count on every rank)
    _linked: frozenset = frozenset()  # the peers this rank's transport is set up with

    def one_sided_with(self, peer: int) -> bool:
        """Whether this comm's messages with `peer` are one-sided: its receiver takes them from the sender's
        memory (`transfer.shm`), so a sender packs them into `staging` and a receiver unpacks them where they
        lie (`itake(nbytes, peer, consume)`). Two-sided here."""
        return False

    def staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """`nbytes` of staging for messages (a one-sided transport's: memory its receivers can read)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def release(self, buf: torch.Tensor) -> None:
        """Give back what `staging` returned (here: the garbage collector does)."""

    def run(self, fn, *args):
        """A blocking call on the group (a wait, a collective), guarded when the group has a watchdog."""
        return fn(*args) if self.guard is None else self.guard.run(fn, *args)

    def _aside(self, fn, *args):
        """A blocking call that ending the group's process groups cannot end (a rendezvous on the store),
        guarded from a helper thread."""
        return fn(*args) if self.guard is None else self.guard.run_aside(fn, *args)

    def _blocking(self, device: torch.device, fn, *args):
        """A blocking call on the group's traffic over `device`, guarded: on CUDA (NCCL) on this thread, where
        the monitor's abort ends it; on CPU (gloo) on the helper thread (see `wait`)."""
        if self.guard is None:
            return fn(*args)
        return self.guard.run(fn, *args) if device.type == "cuda" else self.guard.run_aside(fn, *args)

    def _work(self, device: torch.device, op, *args) -> "_Work":
        return _Work(self, op(*args) if self.guard is None else self.guard.post(op, *args), device)

    def wait(self, work, device: torch.device | None = None) -> None:
        """The end of a message or collective over `device` (default: the group's). On CUDA (NCCL) a wait only
        orders the current stream after it; the host blocks in `synchronize`, where the watchdog polls. On CPU
        (gloo) it blocks on the helper thread while this one polls: gloo's wait on a stopped peer (SIGSTOP: its
        connection stays open) ends only at the group's timeout, and shutting the group down does not end it,
        so the caller leaves it there (a daemon, ended by that timeout) and raises the watchdog's line at the
        stall limit."""
        if (device or self.device).type == "cuda":
            work.wait()
        else:
            self._aside(work.wait)

    def connect(self, peers=(), *, groups=(), tag: str | None = None) -> None:
        """Set up the transport before the first byte, under the watchdog: this rank's side of the pair with
        each of `peers`, and each of `groups` ((member ranks, process group), this rank a member; in the same
        order on every member). Collective over the ranks of each step; pairs already set up are skipped. `tag`:
        the steps' names on the store, the same on every rank (default: the next engine set-up's). Without a
        watchdog nothing is done (the transport sets itself up on first use)."""
        if tag is None:
            self._links += 1
            tag = f"engine/{self._links}"
        if self.guard is None:
            return
        pairs = sorted((min(self.rank, p), max(self.rank, p)) for p in set(peers) - self._linked - {self.rank})
        steps = [_Step(tuple(m), pg) for m, pg in groups] + [_Step(p) for p in pairs]
        if not steps:
            return
        links = _Links(self, tag, self.device)
        event = self.guard.run_aside(links.run, steps, overdue=links.overdue)
        self._linked = self._linked | {b if a == self.rank else a for a, b in pairs}
        if event is not None:
            self.guard.sync(event, what="setting up the transport")

    def synchronize(self, device=None, *, what: str = "the transfer") -> None:
        """Block the host until the work queued on `device`'s current stream is done (CUDA; nothing on CPU):
        polled under the watchdog, so a dead peer's kernel ends the wait with its line, not NCCL's timeout."""
        device = torch.device(device) if device is not None else self.device
        if device.type != "cuda":
            return
        if self.guard is None:
            torch.cuda.synchronize(device)
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self.guard.sync(event, what=what)

    def fail(self, line: str, ranks: tuple = ()):
        """Give the group up with `line` (told to every other rank first, with a watchdog); raises GroupBroken."""
        if self.guard is None:
            raise GroupBroken(line, ranks)
        self.guard.fail(Fault(line, tuple(ranks)))

    def note(self, key: str, value: str) -> None:
        """Record `value` under `key` on the group's store (with a watchdog: its own client), where every rank
        can read it even after the group broke; nothing without one."""
        if self.guard is not None:
            try:
                self.guard.watchdog.store.set(f"note/{key}", value)
            except Exception:  # noqa: BLE001 - the store is gone: nobody is left to read it
                pass

    def read(self, keys: list[str]) -> list[str | None] | None:
        """What `note` recorded under `keys` (None for a key never recorded); None without a store."""
        if self.guard is None or self.guard.watchdog.store is None:
            return None
        store = self.guard.watchdog.store
        out: list[str | None] = []
        try:
            for key in keys:
                out.append(store.get(f"note/{key}").decode() if store.check([f"note/{key}"]) else None)
        except Exception:  # noqa: BLE001 - the store is gone
            return None
        return out

    def name_ranks(self, roles: list[str]) -> None:
        """What each rank is ("trainer 0", "vLLM worker 1"), for the watchdog's lines."""
        if self.guard is not None:
            self.guard.watchdog.roles = list(roles)


class WorldComm(_Comm):
    """The default process group (guarded while `reshard run`'s launcher holds the job: `watch`; a `Refit`
    over a group nobody guards keeps one of its own). Guarded, every wait is bounded by the stall limit: gloo's
    run on the helper thread, NCCL's on this one (see `_Comm`)."""

    _subs = 0  # sub-groups made (collective: every rank calls new_group, in the same order)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    @property
    def device(self) -> torch.device:
        """Where the default group's own collectives (objects, barriers) run: this rank's GPU under NCCL."""
        try:
            kind = dist.distributed_c10d._get_object_coll_device()
        except Exception:  # noqa: BLE001 - no group yet, or a version without it: by the backend's name
            kind = "cuda" if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower() else "cpu"
        return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else CPU

    def isend(self, t: torch.Tensor, peer: int):
        return self._work(t.device, dist.isend, t, peer)

    def irecv(self, t: torch.Tensor, peer: int):
        return self._work(t.device, dist.irecv, t, peer)

    def new_group(self, ranks: list[int]):
        """Collective (every rank, same order); guarded (its members connect over the store), and its own
        communicators set up at once on its members (`connect`)."""
        members = sorted(set(ranks))
        self._subs += 1
        group = self._aside(dist.new_group, members)
        if self.rank in members:
            if self.guard is not None:
                self.guard.abortables.append(group)
            self.connect(groups=[(members, group)], tag=f"sub/{self._subs}")
        return group

    def _send(self, t: torch.Tensor, peer: int):
        return dist.isend(t, peer)

    def _recv(self, t: torch.Tensor, peer: int):
        return dist.irecv(t, peer)

    def _all_reduce(self, t: torch.Tensor, group):
        return dist.all_reduce(t, group=group, async_op=True)

    def broadcast(self, t: torch.Tensor, root: int, group) -> None:
        self._blocking(t.device, partial(dist.broadcast, t, src=root, group=group))

    def barrier(self) -> None:
        self._blocking(self.device, dist.barrier)

    def all_gather_object(self, obj, *, what: str = "") -> list:
        out: list = [None] * self.size  # (NCCL: it reads sizes on the host, on this thread: the monitor's abort
        self._blocking(self.device, dist.all_gather_object, out, _tagged(what, obj))  # ends a blocked read)
        return _untag(out, what, self.rank)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """`t` reduced over every rank, in place (a host tensor's value is ready on return)."""
        self._blocking(t.device, partial(dist.all_reduce, t, op=op))

    def all_reduce_max(self, t: torch.Tensor) -> None:
        self.all_reduce(t, dist.ReduceOp.MAX)
        self.synchronize(t.device, what="a collective")

    def watch(self, guard: Guard | None) -> None:
        """Guard the default group's waits with `guard` (None: stop)."""
        if self.guard is not None and guard is None:
            self.guard.close()
        self.guard, self._linked = guard, frozenset()  # a new job's group: no pair is set up yet


class GroupComm(_Comm):
    """A stand-alone ProcessGroup (not registered with torch.distributed), for example from `refit_group`."""

    def __init__(self, pg, rank: int, size: int, device: torch.device | str = "cpu", guard: Guard | None = None,
                 store=None, timeout: float = 300.0):
        self.pg, self._rank, self._size = pg, rank, size
        self.device = torch.device(device)  # where the group's own small tensors live (cuda for NCCL)
        self.guard = guard
        self._store, self.timeout = store, timeout  # the store sub-groups rendezvous on
        self.link_limit = timeout / 2  # a set-up step is named before the transport's own timeout
        self._subgroups: dict[tuple, SubGroup | None] = {}  # member ranks -> this rank's sub-group (None: not in it)
        if guard is not None and pg is not None:
            guard.abortables.append(pg)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def isend(self, t: torch.Tensor, peer: int):
        return self._work(t.device, self.pg.send, [t], peer, 0)

    def irecv(self, t: torch.Tensor, peer: int):
        return self._work(t.device, self.pg.recv, [t], peer, 0)

    def _send(self, t: torch.Tensor, peer: int):
        return self.pg.send([t], peer, 0)

    def _recv(self, t: torch.Tensor, peer: int):
        return self.pg.recv([t], peer, 0)

    def _all_reduce(self, t: torch.Tensor, pg):
        return pg.allreduce([t])

    def close(self) -> None:
        """End the group for good: its process groups and sub-groups shut down (NCCL's aborted), the heartbeat
        and helper threads stopped and joined, and every reference to the store dropped, so rank 0's store
        server stops and its port is free for the next group (the same host:port may be used again at once)."""
        broken = self.guard is not None and self.guard.broken is not None
        stuck = self.guard.close() if self.guard is not None else False
        pgs = [pg for pg in [self.pg, *(s.pg for s in self._subgroups.values() if s is not None)] if pg is not None]
        for pg in pgs:
            _end(pg)
        pg = None  # noqa: F841 - the loop's last reference
        self.pg, self._store, self._subgroups, self.guard = None, None, {}, None
        if stuck:  # a wait still blocked on a stopped peer: the last references dropped on a thread of their own
            release_aside(pgs)
        pgs.clear()
        if broken:  # the error's frames refer back to the group (a cycle): collected now, so its sockets and
            gc.collect()  # rank 0's store close here, not at some later collection

    def share(self, obj, root: int = 0):
        """`obj` from refit rank `root` on every rank that calls this (not a collective of the whole group: only
        the ranks that need it call, in the same order), through the group's store. The root only writes; a
        reader's wait is guarded, so a root that died or stalled is named, not waited for."""
        if self._store is None:
            raise ConfigError("this refit group has no store to share through (make it with refit_group)",
                              key="group")
        self._shared = getattr(self, "_shared", 0) + 1
        key = f"reshard-share/{self._shared}"
        if self._rank == root:
            self._store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self._aside(self._store.get, key))  # noqa: S301 - this job's own processes

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
            sub = SubGroup(self._aside(self._make_pg, store, members.index(self._rank), len(members)), members)
            if self.guard is not None:
                self.guard.abortables.append(sub.pg)
        self._subgroups[members] = sub
        if sub is not None:  # its communicators, now and under the watchdog
            self.connect(groups=[(members, sub.pg)], tag=prefix.removeprefix("reshard-"))
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

    def all_gather_object(self, obj, *, what: str = "") -> list:
        """Every rank's `obj` (pickled, as torch's own all_gather_object does, between this job's processes).
        `what`: the step it belongs to; a peer in another step (its program went another way after a failure)
        is named, instead of its object being taken for this step's."""
        dev = self.device
        data = torch.frombuffer(bytearray(pickle.dumps(_tagged(what, obj))), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self._size)]
        self.wait(self.pg.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.int64, device=dev)]))
        self.synchronize(what="a collective")  # the sizes are read on the host
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
        padded[:data.numel()] = data.to(dev)
        outs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(self._size)]
        self.wait(self.pg.allgather([outs], [padded]))
        self.synchronize(what="a collective")
        return _untag([pickle.loads(o[:int(s.item())].cpu().numpy().tobytes())  # noqa: S301
                       for o, s in zip(outs, sizes)], what, self._rank)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        moved = t.to(self.device)
        self.wait(self.pg.allreduce([moved], opts))
        self.synchronize(what="a collective")
        if moved is not t:
            t.copy_(moved)


_TAG = "reshard-collective"


def _tagged(what: str, obj):
    return (_TAG, what, obj)


def _untag(gathered: list, what: str, me: int) -> list:
    """The objects of a tagged all_gather_object; a rank whose object is not this step's (another step of
    reshard's, or a collective of the program's own that paired with this one) is one line, not a failed
    unpacking further on."""
    out = []
    for r, item in enumerate(gathered):
        if isinstance(item, tuple) and len(item) == 3 and item[0] == _TAG and item[1] == what:
            out.append(item[2])
            continue
        theirs = (f"'{item[1] or 'a refit collective'}'" if isinstance(item, tuple) and len(item) == 3 and
                  item[0] == _TAG else "a collective that is not reshard's")
        raise GroupBroken(f"refit rank {r} is in {theirs} while rank {me} is in '{what or 'a refit collective'}': "
                          f"the ranks' programs went different ways (a rank that failed earlier went on); "
                          f"the group cannot be used", (r,))
    return out


class SubGroup:
    """A sub-group of a refit group: its ProcessGroup (ranks 0..n-1) and the refit ranks of its members."""

    def __init__(self, pg, ranks: tuple):
        self.pg, self.ranks = pg, ranks


class _Work:
    """A message of a comm, whose wait the comm's watchdog can end."""

    __slots__ = ("comm", "work", "device")

    def __init__(self, comm: _Comm, work, device: torch.device):
        self.comm, self.work, self.device = comm, work, device

    def wait(self) -> None:
        self.comm.wait(self.work, self.device)


@dataclass(frozen=True)
class _Step:
    """One step of setting up the transport: a pair of ranks (lower first), or a group's members and process
    group."""

    members: tuple
    pg: object = None

    @property
    def key(self) -> str:
        return ("g" if self.pg is not None else "p") + "-".join(map(str, self.members))

    def what(self, rank: int, size: int, who) -> str:
        """The step as `rank` takes part in it ("with refit rank 3")."""
        if self.pg is None:
            return "with " + who(self.members[1] if self.members[0] == rank else self.members[0])
        if len(self.members) == size:
            return "for the whole group"
        return f"for the sub-group of ranks {', '.join(map(str, self.members))}"


def _link(comm: _Comm, links: "_Links", step: _Step, device: torch.device) -> None:
    """One step of setting up the transport, on the helper thread: a group's first collective, or a pair's
    first message (the lower rank sends), each making its communicators (NCCL); said on the store first."""
    links.enter(step)
    t = torch.zeros(1, device=device)
    if step.pg is not None:
        comm._all_reduce(t, step.pg).wait()
    elif comm.rank == step.members[0]:
        comm._send(t, step.members[1]).wait()
    else:
        comm._recv(t, step.members[0]).wait()


class _Links:
    """One `connect`: its steps on the helper thread, each said on the group's store (`at/<rank>`: the step this
    rank is in; `<tag>/<step>/in/<rank>`: this rank is past its own part, in the transport). `overdue`, on the
    caller's thread: once the current step has made no progress for the comm's link limit, the rank that
    holds it up, followed from rank to rank through the steps they are in."""

    def __init__(self, comm: _Comm, tag: str, device: torch.device):
        self.comm, self.tag, self.device = comm, tag, device
        self.watchdog = comm.guard.watchdog
        self.store = self.watchdog.store
        self.step: _Step | None = None
        self.since = time.monotonic()

    def run(self, steps: list) -> "torch.cuda.Event | None":
        me = self.comm.rank
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            for step in steps:
                self.step, self.since = step, time.monotonic()
                self.store.set(f"link/at/{me}", f"{self.tag}/{step.key}|{','.join(map(str, step.members))}")
                try:
                    _link(self.comm, self, step, self.device)
                except Exception as e:  # noqa: BLE001 - whose fault it was: the guard asks the watchdog
                    what = step.what(me, self.comm.size, self.watchdog.who)
                    raise RuntimeError(f"setting up its transport {what}: {type(e).__name__}: {e}") from e
            self.step = None
            self.store.set(f"link/at/{me}", "done")
            if self.device.type != "cuda":
                return None
            event = torch.cuda.Event()
            event.record()
            return event

    def enter(self, step: _Step) -> None:
        self.store.set(f"link/{self.tag}/{step.key}/in/{self.comm.rank}", "1")

    def overdue(self) -> Fault | None:
        step = self.step
        if step is None or time.monotonic() - self.since < self.comm.link_limit:
            return None
        try:
            return self._blame(f"{self.tag}/{step.key}", step)
        except Exception:  # noqa: BLE001 - the store is gone: the watchdog names its host
            return None

    def _blame(self, key: str, step: _Step) -> Fault:
        who, limit, seen = self.watchdog.who, f"{self.comm.link_limit:.0f}", set()
        while True:
            seen.add(key)
            late = [r for r in step.members if not self.store.check([f"link/{key}/in/{r}"])]
            if not late:  # every member is in the transport, which did not finish
                names = " and ".join(who(r) for r in step.members[:4])
                return Fault(f"{names}: setting up the transport between them did not finish within {limit} s "
                             f"(every one of them was in it)", step.members)
            r = late[0]
            at = self.store.get(f"link/at/{r}").decode() if self.store.check([f"link/at/{r}"]) else ""
            where, _, members = at.partition("|")
            if where == key:  # stuck in its own part of this step
                return Fault(f"{who(r)}: setting up its transport {step.what(r, self.comm.size, who)} did not "
                             f"finish within {limit} s", (r,))
            if where in seen or not members:  # busy elsewhere (not setting up), or a cycle: it is the one
                return Fault(f"{who(r)}: did not reach setting up its transport {step.what(r, self.comm.size, who)} "
                             f"within {limit} s", (r,))
            grouped = where.rpartition("/")[2].startswith("g")  # a group's step: its process group is not needed
            key, step = where, _Step(tuple(int(m) for m in members.split(",")), True if grouped else None)


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
    store = connect_store(host, port, rank, size, timeout)
    prefixed = dist.PrefixStore("reshard-refit", store)
    watchdog = Watchdog(store, rank, size, stall=min(timeout / 2, STALL) if stall is None else stall)
    try:
        check_in(prefixed, rank, size, timeout, abort, names)
    except dist.DistError as e:  # rank 0 left (an abort whose reason came too late here), or its host died
        watchdog.close()
        raise RuntimeFailure(f"refit group: rank 0's store at {host}:{port} went away while rank {rank} was "
                             f"joining ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
                             f"; the group was given up") from None
    except BaseException:
        watchdog.close()
        raise
    comm = GroupComm(None, rank, size, device if device.type == "cuda" else "cpu",
                     guard=Guard(watchdog, device if device.type == "cuda" else None), store=store, timeout=timeout)
    comm.name_ranks([names(r) if names else "" for r in range(size)])
    watchdog.start()
    try:  # the rendezvous is guarded too: a store that goes away under it (rank 0 failed) ends it in seconds
        comm.pg = comm._aside(comm._make_pg, prefixed, rank, size)  # the store (on rank 0, its server) lives as
        comm.guard.abortables.append(comm.pg)  # long as the group
        comm.connect(groups=[(tuple(range(size)), comm.pg)], tag="group")  # its communicators: now, guarded
    except BaseException:
        comm.close()
        raise
    return comm


WORLD = WorldComm()
