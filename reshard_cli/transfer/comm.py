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

import gc
import pickle
import threading
import time
from functools import partial
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from reshard_cli.errors import ConfigError, RuntimeFailure
from reshard_cli.transfer.watchdog import Fault, GroupBroken, Guard, Watchdog, _end, stale

STALL = 10.0  # seconds without a heartbeat after which a refit group's peer is named as stalled (at most; half
# the group's timeout when that is shorter, so the watchdog speaks before the transport times out); heartbeats
# come every second on a store client of their own, so a busy rank still beats


class _Comm:
    """What both comms share: an optional `guard` (`transfer.watchdog.Guard`) whose watchdog ends every wait
    on the group's traffic as soon as any rank reports a fault or stops answering, with a line naming that
    rank (`GroupBroken`), instead of at the timeout."""

    guard: Guard | None = None
    device = torch.device("cpu")  # where the group's collectives run (cuda: NCCL)

    def run(self, fn, *args):
        """A blocking call on the group (a wait, a collective), guarded when the group has a watchdog."""
        return fn(*args) if self.guard is None else self.guard.run(fn, *args)

    def _aside(self, fn, *args):
        """A blocking call that ending the group's process groups cannot end (a rendezvous on the store),
        guarded from a helper thread."""
        return fn(*args) if self.guard is None else self.guard.run_aside(fn, *args)

    def _work(self, op, *args) -> "_Work":
        return _Work(self, op(*args) if self.guard is None else self.guard.post(op, *args))

    def wait(self, work) -> None:
        """The end of a message or collective. On CUDA (NCCL) a wait only orders the current stream after it;
        the host blocks in `synchronize`, where the watchdog polls. On CPU (gloo) it blocks on the helper
        thread while this one polls: gloo's wait on a stopped peer (SIGSTOP: its connection stays open) ends
        only at the group's timeout, and shutting the group down does not end it, so the caller leaves it
        there (a daemon, ended by that timeout) and raises the watchdog's line at the stall limit."""
        if self.device.type == "cuda":
            work.wait()
        else:
            self._aside(work.wait)

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
        group = dist.new_group(ranks)
        if self.guard is not None and group is not None:
            self.guard.abortables.append(group)
        return group

    def broadcast(self, t: torch.Tensor, root: int, group) -> None:
        self.run(partial(dist.broadcast, t, src=root, group=group))

    def barrier(self) -> None:
        self.run(dist.barrier)

    def all_gather_object(self, obj, *, what: str = "") -> list:
        out: list = [None] * self.size
        self.run(dist.all_gather_object, out, _tagged(what, obj))  # (on NCCL it reads sizes on the host: its
        return _untag(out, what, self.rank)  # helper thread blocks there, the caller polls the watchdog)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        self.run(partial(dist.all_reduce, t, op=dist.ReduceOp.MAX))
        self.synchronize(t.device, what="a collective")

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
        if guard is not None and pg is not None:
            guard.abortables.append(pg)

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
            _release_aside(pgs)
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
    store = _connect(host, port, rank, size, timeout)
    prefixed = dist.PrefixStore("reshard-refit", store)
    watchdog = Watchdog(store, rank, size, stall=min(timeout / 2, STALL) if stall is None else stall)
    try:
        _check_in(prefixed, rank, size, timeout, abort, names)
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
    except BaseException:  # long as the group
        comm.close()
        raise
    comm.guard.abortables.append(comm.pg)
    return comm


_RELEASING: set = set()  # threads dropping a broken group's process groups (`_release_aside`)


def _release_aside(pgs: list) -> None:
    """Drop the last references to a broken group's process groups on a daemon thread: destroying a gloo group
    whose collective is still blocked on a stopped peer (SIGSTOP: its connections stay open) waits for that
    collective's timeout, and the caller must not (the fleet's survivors resume in a new group meanwhile).
    Rank 0's store, which the group holds, is freed when the thread ends; a new group on its port waits for it
    (`_connect`). A process that exits meanwhile leaves the thread, and the group, as they are."""
    def release(held: list) -> None:
        held.clear()  # the destructors run here
        _RELEASING.discard(threading.current_thread())

    thread = threading.Thread(target=release, args=(list(pgs),), daemon=True, name="reshard-release")
    pgs.clear()
    _RELEASING.add(thread)
    thread.start()


def _connect(host: str, port: int, rank: int, size: int, timeout: float):
    """The group's store: rank 0 serves it, the others connect. A store that still answers for a group that is
    over (closed or given up; its host has not stopped it yet) is left, and the connection tried again, until
    `timeout`: the same host:port serves one group after another."""
    deadline = time.monotonic() + timeout
    collected = False
    while True:
        left = max(deadline - time.monotonic(), 1.0)
        try:
            store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timedelta(seconds=left),
                                  wait_for_workers=False)
        except (dist.DistStoreError, RuntimeError) as e:  # a port in use, or no rank 0 listening in time
            if rank == 0 and not collected and "EADDRINUSE" in str(e):  # this process's own earlier group,
                collected = True  # kept alive only by a reference cycle (an exception's frames): collect it
                gc.collect()
                continue
            if rank == 0 and _RELEASING and "EADDRINUSE" in str(e):  # or a broken one still being released
                for thread in list(_RELEASING):
                    thread.join(timeout=max(deadline - time.monotonic(), 0.0))
                gc.collect()  # what the blocked collective's end left in cycles (its error's frames)
                if time.monotonic() < deadline:
                    continue
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            where = "could not listen on" if rank == 0 else "could not reach rank 0's store at"
            raise RuntimeFailure(f"refit group: rank {rank} {where} {host}:{port} within {timeout:.0f} s "
                                 f"({first})") from None
        try:
            if rank == 0 or not stale(store):
                return store
        except dist.DistError:  # it went away as this rank looked: the next one is the new group's
            pass
        del store
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"refit group: rank {rank} found only a finished group's store at {host}:{port} "
                                 f"within {timeout:.0f} s (its host never served a new one)")
        time.sleep(0.2)


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


def world_guard(device: torch.device | None, *, stall: float, label: str, prefix: str = "") -> Guard | None:
    """A watchdog over the default process group, on the store it was made with when the job set it up from
    the environment (torchrun, or MASTER_ADDR/MASTER_PORT: a client connection of its own); None when it did
    not. Its heartbeat key exists at once; start it (`Watchdog.start`) once every rank has made its own (after
    a collective). A fault shuts the default group down: a wait blocked in it ends. `prefix`: keys of their
    own on that store."""
    import os

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not dist.is_initialized():
        return None
    client = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=60))
    watchdog = Watchdog(client, dist.get_rank(), dist.get_world_size(), stall=stall, label=label, prefix=prefix)
    watchdog.store_client = client  # kept alive with the watchdog
    guard = Guard(watchdog, device if device is not None and device.type == "cuda" else None)
    guard.abortables.append(dist.group.WORLD)
    return guard
