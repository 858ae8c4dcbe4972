"""A refit group's store: where its ranks meet before any process group exists, and where a group that ended
is let go of.

  connect_store  rank 0 serves the group's TCP store, the others connect; a store left over from a group that
                 is over (closed, or given up after a fault) is recognized and waited out, so one host:port
                 serves one group after another
  check_in       every rank says it came and waits for the others, polling a reason to give up (`abort_group`:
                 a process that cannot join tells the others why, instead of letting them time out)
  release_aside  a broken group's process groups dropped on a thread of their own while a wait is still blocked
                 in them (destroying a gloo group blocked on a stopped peer waits for its timeout)
  world_guard    the watchdog of a torchrun job's default group, on the job's own store

`comm` builds the groups on these (`refit_group`) and carries their traffic.
"""
from __future__ import annotations

import atexit
import gc
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from reshard_cli.errors import RuntimeFailure
from reshard_cli.transfer.watchdog import Guard, Watchdog, in_torch, stale, stop_all

_RELEASING: set = set()  # threads dropping a broken group's process groups (`release_aside`)


def release_aside(pgs: list) -> None:
    """Drop the last references to a broken group's process groups on a daemon thread: destroying a gloo group
    whose collective is still blocked on a stopped peer (SIGSTOP: its connections stay open) waits for that
    collective's timeout, and the caller must not (the fleet's survivors resume in a new group meanwhile).
    Rank 0's store, which the group holds, is freed when the thread ends; a new group on its port waits for it
    (`connect_store`). A process that exits meanwhile waits for the thread (`watchdog.stop_all`, at most
    `watchdog.EXIT_GRACE` seconds): one that returns into a torn-down interpreter aborts it."""
    def release(held: list) -> None:
        held.clear()  # the destructors run here
        _RELEASING.discard(threading.current_thread())

    thread = threading.Thread(target=release, args=(list(pgs),), daemon=True, name="reshard-release")
    pgs.clear()
    _RELEASING.add(thread)
    in_torch(thread)  # waited for at exit (`watchdog.stop_all`)
    thread.start()


CONNECT_GRACE = 10.0  # seconds past its timeout a store client may take before it is given up as unanswered


class Unanswered(RuntimeError):
    """Something at host:port accepted the connection and never answered as a store."""


def store_client(host: str, port: int, timeout: float):
    """A client connection to the TCP store at host:port, or an error within `timeout` + CONNECT_GRACE seconds.
    TCPStore's own client waits without end on a listener that accepts and never answers (another program's
    port: docs/upstream/tcpstore-client-outlives-its-timeout.md), so it connects on a daemon thread, which is
    left where it is blocked when it takes too long (Unanswered)."""
    box: dict = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                                         wait_for_workers=False)
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
            box["error"] = e

    thread = threading.Thread(target=connect, daemon=True, name="reshard-connect")
    thread.start()
    thread.join(timeout + CONNECT_GRACE)
    if thread.is_alive():
        raise Unanswered(f"something there accepted the connection and did not answer as a store within "
                         f"{timeout + CONNECT_GRACE:.0f} s: another program's port?")
    if "error" in box:
        raise box["error"]
    return box["store"]


def connect_store(host: str, port: int, rank: int, size: int, timeout: float):
    """The group's store: rank 0 serves it, the others connect. A store that still answers for a group that is
    over (closed or given up; its host has not stopped it yet) is left, and the connection tried again, until
    `timeout`: the same host:port serves one group after another."""
    deadline = time.monotonic() + timeout
    collected = False
    while True:
        left = max(deadline - time.monotonic(), 1.0)
        try:
            store = (dist.TCPStore(host, port, size, is_master=True, timeout=timedelta(seconds=left),
                                   wait_for_workers=False) if rank == 0 else store_client(host, port, left))
        except (dist.DistStoreError, RuntimeError) as e:  # a port in use, no rank 0 listening in time, or a
            # listener that is not a store
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
        store = store_client(host, port, timeout)
        prefixed = dist.PrefixStore("reshard-refit", store)
        prefixed.set("abort", reason)
        if rank is not None:
            prefixed.set(f"seen/{rank}", "1")
    except (dist.DistError, RuntimeError):
        pass


def check_in(store, rank: int, size: int, timeout: float, abort, names=None) -> None:
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


# (MASTER_ADDR, MASTER_PORT) -> client connections to the job's store that no watchdog uses now: the next
# refit's watchdog takes them. A new connection costs a round of the store's handshake, and with several
# ranks connecting at once torch's TCPStore client sometimes waits 5 s in it (measured with 6 ranks, torch 2.13).
_JOB_CLIENTS: dict[tuple, list] = {}


@atexit.register  # registered after watchdog's own `stop_all` (imported above), so it runs first
def _drop_clients() -> None:
    """At exit, once every watchdog has stopped (and given its clients back): the idle connections closed
    while the interpreter is whole, not left to its teardown."""
    stop_all()
    _JOB_CLIENTS.clear()


def world_guard(device: torch.device | None, *, stall: float, label: str, prefix: str = "") -> Guard | None:
    """A watchdog over the default process group, on the store it was made with when the job set it up from
    the environment (torchrun, or MASTER_ADDR/MASTER_PORT: two client connections of its own, taken from the
    job's idle ones where an earlier watchdog gave them back); None when it did not. Its heartbeat key exists
    at once; start it (`Watchdog.start`) once every rank has made its own (after a collective). A fault shuts
    the default group down: a wait blocked in it ends. `prefix`: keys of their own on that store."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not dist.is_initialized():
        return None
    idle = _JOB_CLIENTS.setdefault((addr, int(port)), [])
    clients = [idle.pop() if idle else dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=60))
               for _ in range(2)]
    watchdog = Watchdog(clients[0], dist.get_rank(), dist.get_world_size(), stall=stall, label=label, prefix=prefix,
                        clients=clients, release=idle.append)
    guard = Guard(watchdog, device if device is not None and device.type == "cuda" else None)
    guard.abortables.append(dist.group.WORLD)
    return guard
