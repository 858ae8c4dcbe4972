"""Naming the rank that failed, died or stalled, on every other rank of a refit group, quickly.

A collective or a message blocked on a peer that will never answer waits for the group's timeout in gloo (and
then says only "Connection closed by peer [ip]:port" or "Timed out waiting"); a rank that raised leaves its
peers waiting for bytes that will not come. So a refit group carries a watchdog over its own TCP store:

  heartbeat   every rank's daemon thread adds 1 to `hb/<rank>` every `interval` seconds, over a store client of
              its own (a TCPStore client holds its lock for a whole `wait`, so a beat sharing one with a
              rendezvous would stop while the rendezvous waits, and a healthy rank would be named); a beat
              that fails is retried until the group closes. A process that is stopped (SIGSTOP), killed, or
              hung with the interpreter locked stops counting.
  faults      a rank that fails on its own (an exception mid-transfer) writes its one-line error under
              `fault` (the first one stays) before it gives up; so does a rank that found a stalled peer. Each
              rank that reads it says so (`seen/<rank>`), and rank 0, whose process holds the store, keeps it
              until the others have (or died: `linger`) before its group ends.
  waits       every wait on the group's traffic runs on a helper thread while the caller polls the store
              (`check`, on a client of its own too) twice a second: the first reported fault, or a peer whose
              count has not moved for `stall` seconds, ends the wait with that line (`GroupBroken`). A transport error (a dead peer's
              closed connection) is explained the same way: the peer whose count stopped within a few
              seconds is named, not the socket. The store itself lives in refit rank 0's process: when it is
              gone, that rank is named.

  CUDA        an NCCL `wait` only orders streams: the host blocks later, in a synchronize or a host read of a
              device value. Those run as `Guard.sync`: an event recorded on the stream is polled (never waited
              on blindly), the watchdog checked between polls; a fault aborts the group's communicators
              (`Guard.abortables`: NCCL's abort), so no kernel stays blocked and the process survives.

After a `GroupBroken` the group is not used again: its process groups are shut down (NCCL aborted), which
also ends a helper thread still blocked in the transport; the next refit joins a new group. A guard that was
closed (its group is over) refuses every later wait with one line instead of watching heartbeats that stopped.

The same watchdog runs over a torchrun job's own store in `reshard run` (the launcher's `process_group`), where
the waits are the default group's (`comm.WorldComm`).
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch.distributed as dist

from reshard_cli.errors import RuntimeFailure

POLL = 0.5  # seconds between two looks at the store while a wait is blocked
DEATH_WINDOW = 3.0  # after a transport error: how long a peer's silent heartbeat takes to say it died
NO_FAULT = "\0"  # what `check` reads under `fault` while no rank has reported one


_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # watchdogs and guards whose threads run: stopped at exit
IN_TORCH: set = set()  # daemon threads left inside a torch call (a wait blocked on a stopped peer, a broken
# group's process groups being destroyed): waited for at exit, `EXIT_GRACE` seconds at most
EXIT_GRACE = 30.0


def in_torch(thread: threading.Thread) -> None:
    """`thread` is left inside a torch call: the process waits for it at exit (`stop_all`)."""
    IN_TORCH.difference_update([t for t in IN_TORCH if not t.is_alive()])
    IN_TORCH.add(thread)


@atexit.register
def stop_all() -> None:
    """Before the interpreter tears down: stop every heartbeat and idle helper thread and wait for them, and
    for the threads left inside a torch call (`IN_TORCH`). A daemon thread whose torch call returns after the
    teardown has begun aborts the process in C++ ("terminate called without an active exception": CPython
    ends the thread as it asks for the GIL back, and the unwinding meets a noexcept frame), for example a
    script that never closes its refit group, or a fleet that dropped a stopped member just before it ends."""
    for item in list(_LIVE):
        item.close()
    deadline = time.monotonic() + EXIT_GRACE
    for thread in list(IN_TORCH):
        thread.join(timeout=max(deadline - time.monotonic(), 0.0))


class GroupBroken(RuntimeFailure):
    """A group's peer failed, died or stalled; the group cannot carry another byte. `ranks`: the ranks the line
    names (who failed, died or stalled)."""

    group_broken = True  # what the launcher looks for: no collective can complete, the line says why

    def __init__(self, message: str, ranks: tuple = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


@dataclass(frozen=True)
class Fault:
    line: str
    ranks: tuple = ()  # the ranks it names


class Watchdog:
    def __init__(self, store, rank: int, size: int, *, interval: float = 1.0, stall: float = 10.0,
                 label: str = "refit rank", prefix: str = "", clients: tuple = (), release=None):
        """`prefix`: the keys' own space on a store other users share (torchrun's). `clients`: two client
        connections of the watchdog's own to `store`'s server (checks, beats), instead of new ones; once the
        group is over and its threads stopped, `give_back` hands them to `release`."""
        self._base, self._prefix = store, prefix + "reshard-watch"
        self._clients, self._release = tuple(clients), release
        self._beat_stopped = True
        self.store = dist.PrefixStore(self._prefix, clients[0] if clients else _own_client(store))  # checks, reports
        self.rank, self.size, self.interval, self.stall, self.label = rank, size, interval, stall, label
        self.roles: list[str] = [""] * size  # what each rank is, once the group knows ("trainer 0")
        now = time.monotonic()
        self._seen = {r: (None, now) for r in range(size) if r != rank}  # rank -> (count, when it last moved)
        self._stop = threading.Event()
        self._acked = False  # this rank said it read the group's fault (`linger`)
        self.store.add(f"hb/{rank}", 1)  # before the check-in: every key exists once the group has formed
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        beat_store = dist.PrefixStore(self._prefix, self._clients[1] if self._clients else _own_client(self._base))
        self._beat_stopped = False  # its client is never shared while it beats: see above
        self._thread = threading.Thread(target=self._beat, args=(beat_store,), name=f"reshard-heartbeat-{self.rank}",
                                        daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _beat(self, store) -> None:
        while not self._stop.wait(self.interval):
            try:
                store.add(f"hb/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - a slow or lost store: tried again until the group closes (a
                pass  # store that is gone is named by the waits)

    def close(self) -> None:
        """Stop the heartbeat, and wait for its thread: a process that exits while it is inside a store call
        can abort in C++. The store clients are dropped with the watchdog."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5)
            self._beat_stopped = not self._thread.is_alive()
        self._thread = None
        self._base = None  # the store this group was made on: its server (rank 0) stops with the last reference

    def give_back(self) -> None:
        """The clients it was given, to `release`, once nothing of this group uses them (its beat stopped);
        a beat still inside a store call keeps its client."""
        if self._release is not None and self._beat_stopped:
            release, self._release = self._release, None
            self.store = None  # another group's watchdog may use them next: this one never touches them again
            for client in self._clients:
                release(client)

    def mark_closed(self) -> None:
        """Say on the store that this group is over: a rank joining the next group on the same host:port while
        this store still answers (its host has not closed it yet) knows it for a stale one."""
        try:
            self.store.set("closed", "1")
        except Exception:  # noqa: BLE001 - the store is gone: nobody can join it
            pass

    def who(self, rank: int) -> str:
        role = self.roles[rank] if rank < len(self.roles) else ""
        return f"{self.label} {rank}" + (f" ({role})" if role else "")

    def report(self, fault: Fault) -> None:
        """Tell every rank of the group this fault (the first one reported is the one every rank names): its
        line is written whole in one step, so a rank that sees it can read it in the same step."""
        try:
            self.store.compare_set("fault", "", ",".join(map(str, fault.ranks)) + "|" + fault.line)
            self.store.add("faults", 1)  # (how `stale` tells a group given up)
            self._read()
        except Exception:  # noqa: BLE001 - no store: the others find out from it being gone
            pass

    def _read(self) -> None:
        """Say on the store that this rank has read the group's fault (`linger`)."""
        if not self._acked:
            self._acked = True
            self.store.add(f"seen/{self.rank}", 1)

    def check(self, stall: float | None = None) -> Fault | None:
        """The first fault reported, or the peers silent for `stall` seconds; None if all is well."""
        try:
            raw = self.store.compare_set("fault", NO_FAULT, NO_FAULT)  # read, in one step; creates nothing
            if raw != NO_FAULT.encode():
                self._read()
                ranks, _, line = raw.decode().partition("|")
                return Fault(line, tuple(int(r) for r in ranks.split(",") if r))
            peers = sorted(self._seen)
            counts = self.store.multi_get([f"hb/{r}" for r in peers])
        except Exception:  # noqa: BLE001 - TCPStore's errors differ by version; any means its server is gone
            return Fault(f"{self.who(0)} stopped answering: the group's store, which that rank holds, is gone "
                         f"(it died or its host is unreachable)", (0,))
        now = time.monotonic()
        limit = self.stall if stall is None else stall
        silent, longest = [], 0.0
        for r, raw in zip(peers, counts):
            count = int(raw)
            last, since = self._seen[r]
            if count != last:
                self._seen[r] = (count, now)
            elif now - since > limit:
                silent.append(r)
                longest = max(longest, now - since)
        if not silent:
            return None
        names = ", ".join(self.who(r) for r in silent[:4]) + (f" and {len(silent) - 4} more" if len(silent) > 4 else "")
        return Fault(f"{names} stopped answering: no heartbeat for {longest:.0f} s (the process died or is stalled)",
                     tuple(silent))

    def linger(self, named: tuple = ()) -> None:
        """On the rank whose process holds the store (rank 0), before a group given up after a fault ends: keep
        the store until every other rank has read the fault, or is one it names, or has gone silent (died), for
        `DEATH_WINDOW` + two beats at most. A peer that looked only after the store was gone would name this
        rank ("the group's store ... is gone") instead of the fault."""
        deadline = time.monotonic() + DEATH_WINDOW + 2 * self.interval
        waiting = set(self._seen) - set(named)
        try:
            while waiting and time.monotonic() < deadline:
                waiting = {r for r in waiting if not self.store.add(f"seen/{r}", 0)}
                peers = sorted(waiting)
                now = time.monotonic()
                for r, raw in zip(peers, self.store.multi_get([f"hb/{r}" for r in peers]) if peers else []):
                    last, since = self._seen[r]
                    if int(raw) != last:
                        self._seen[r] = (int(raw), now)
                    elif now - since > DEATH_WINDOW:
                        waiting.discard(r)
                time.sleep(POLL / 5)
        except Exception:  # noqa: BLE001 - the store is gone already: nothing to keep
            pass

    def cause(self, error: BaseException) -> Fault:
        """Why a transport operation failed: a reported fault, or the peer that stopped within DEATH_WINDOW
        seconds; else the error itself, as this rank's."""
        deadline = time.monotonic() + DEATH_WINDOW + 2 * self.interval
        while time.monotonic() < deadline:
            fault = self.check(stall=DEATH_WINDOW)
            if fault:
                return fault
            time.sleep(POLL / 2)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return Fault(f"{self.who(self.rank)}: transport error ({first})", (self.rank,))


def _own_client(store):
    """A client connection of its own to `store`'s server (TCPStore.clone), where the store can make one."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):  # a store kind without clients of its own
        return store


def stale(store) -> bool:
    """Whether `store` belongs to a group that is over (closed, or given up after a fault): what a rank finds
    when it joins a new group on the same host:port before the old group's host has stopped its store."""
    watch = dist.PrefixStore("reshard-watch", store)
    return bool(watch.check(["closed"])) or watch.add("faults", 0) > 0


class Guard:
    """The waits of one group, ended early by its watchdog; the first fault raises GroupBroken, and every later
    call at once.

    `run(fn)`: a call on the group's process groups, made on the caller's own thread (no hop: a refit waits on
    many messages), while a monitor thread checks the watchdog every POLL seconds for as long as a call has
    been blocked; on a fault it gives the group up, which ends its process groups (`abortables`: NCCL's
    abort, gloo's shutdown) and so the blocked call, which then raises the fault's line. `run_aside(fn)`: a
    call that ending the process groups cannot end (a rendezvous waiting on the store, a gloo wait on a
    stopped peer) runs on a helper thread while the caller polls the watchdog itself. Once closed, neither
    starts its thread again: every later call raises one line."""

    def __init__(self, watchdog: Watchdog, device=None):
        self.watchdog = watchdog
        self.device = device  # a CUDA device: the helper thread works on it too
        self.broken: GroupBroken | None = None
        self.closed = False  # set by close(): the heartbeats have stopped, nothing may wait on them again
        self.abortables: list = []
        self._lock = threading.Lock()  # one fault gives the group up, from the caller or from the monitor
        self._blocked_since: float | None = None  # when the caller's current `run` began
        self._monitor_stop = threading.Event()
        self._monitor_thread: threading.Thread | None = None
        self._calls: queue.SimpleQueue | None = None  # to the helper thread (a daemon: a process may exit while
        # it is still blocked in a rendezvous of a group given up)
        self._helper_thread: threading.Thread | None = None

    def run(self, fn, *args):
        """`fn(*args)` (a wait, or a blocking collective on the group's process groups), on this thread; ended
        early (GroupBroken) by a fault the monitor finds while it is blocked."""
        if self.broken is not None:
            raise self.broken
        if self._monitor_thread is None:
            self._refuse_closed()
            self._monitor_thread = threading.Thread(target=self._monitor, daemon=True,
                                                    name=f"reshard-monitor-{self.watchdog.rank}")
            self._monitor_thread.start()
            _LIVE.add(self)
        self._blocked_since = time.monotonic()
        try:
            return fn(*args)
        except GroupBroken:
            raise
        except Exception as e:  # noqa: BLE001 - the transport's own error, or the monitor's abort: whose fault?
            if self.broken is not None:
                raise self.broken from None
            self.fail(self.watchdog.cause(e))
        finally:
            self._blocked_since = None

    def _monitor(self) -> None:
        while not self._monitor_stop.wait(POLL):
            since = self._blocked_since
            if since is None or self.broken is not None or time.monotonic() - since < POLL:
                continue
            fault = self.watchdog.check()
            if fault and self._blocked_since == since:  # still the same call: an operation that has just
                try:  # finished is not given up (rank 0, the store's host, may leave right after a last round)
                    self.fail(fault)
                except GroupBroken:
                    pass  # the blocked call raises it

    def run_aside(self, fn, *args, overdue=None):
        """`fn(*args)` on the helper thread while this thread polls the watchdog: for a call that ending the
        process groups cannot end (a rendezvous on the store, a gloo wait). `overdue`: asked at each poll, a
        Fault once the call has taken too long (its line names the rank it waits on), else None."""
        if self.broken is not None:
            raise self.broken
        if self._calls is None:
            self._refuse_closed()
            self._calls = queue.SimpleQueue()
            self._helper_thread = threading.Thread(target=self._helper, args=(self._calls,), daemon=True,
                                                   name=f"reshard-wait-{self.watchdog.rank}")
            self._helper_thread.start()
            _LIVE.add(self)
        done: Future = Future()
        self._calls.put((fn, args, done))
        while True:
            try:
                return done.result(timeout=POLL)
            except FutureTimeout:
                fault = self.watchdog.check() or (overdue() if overdue is not None else None)
                if fault and not done.done():  # an operation that has just finished is not given up
                    self.fail(fault)
            except GroupBroken:
                raise
            except Exception as e:  # noqa: BLE001 - the call's own error: whose fault was it?
                self.fail(self.watchdog.cause(e))

    def _helper(self, calls: queue.SimpleQueue) -> None:
        if self.device is not None and getattr(self.device, "type", "cpu") == "cuda":
            import torch

            torch.cuda.set_device(self.device)
        while True:
            item = calls.get()
            if item is None:
                return
            fn, args, done = item
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

    def sync(self, event, *, what: str = "a CUDA stream") -> None:
        """Wait for a CUDA `event` (recorded after the work to wait for: `torch.cuda.Event.record()`; anything
        with `query()`) by polling it, never blocking in the driver: between polls the watchdog is checked,
        and a fault gives the group up (aborting its communicators, so the kernels blocked on a dead peer
        end). `what`: the work, for the line when this rank is the one that fails."""
        if self.broken is not None:
            raise self.broken
        self._refuse_closed()
        pause = 1e-5
        while True:
            try:
                if event.query():
                    return
            except Exception as e:  # noqa: BLE001 - an asynchronous CUDA/NCCL error surfaced by the query
                self.fail(self.watchdog.cause(RuntimeError(f"{what}: {e}")))
            fault = self.watchdog.check() if pause >= POLL else None
            if fault:
                self.fail(fault)
            time.sleep(pause)
            pause = min(pause * 2, POLL)

    def post(self, op, *args):
        """Start a message; a transport that refuses it (a peer's closed connection) is explained like a
        failed wait."""
        if self.broken is not None:
            raise self.broken
        try:
            return op(*args)
        except Exception as e:  # noqa: BLE001
            self.fail(self.watchdog.cause(e))

    def fail(self, fault: Fault, *, report: bool = True):
        """Give the group up with `fault` (told to every other rank first); raises GroupBroken."""
        with self._lock:
            if self.broken is None:
                if report:
                    self.watchdog.report(fault)  # first: a peer that sees the connections close reads why
                self.broken = GroupBroken(fault.line, fault.ranks)
                self.abort()
                if self._calls is not None:
                    self._calls.put(None)  # its thread ends after the call it was blocked in (aborted above)
        raise self.broken

    def abort(self) -> None:
        """End the group's process groups: NCCL's communicators aborted, gloo's connections closed, so a call
        still blocked in one of them returns."""
        for pg in self.abortables:
            _end(pg)
        self.abortables = []

    def _refuse_closed(self) -> None:
        if self.closed:
            raise RuntimeFailure(f"{self.watchdog.who(self.watchdog.rank)}: its group's watchdog was closed (the "
                                 f"group is over): nothing waits on it again")

    def close(self) -> bool:
        """Stop the heartbeat and the helper thread, ending the group's process groups first (a helper thread
        blocked in one of them returns). Whether the helper thread is still blocked (in a gloo wait on a
        stopped peer, which ends only at its timeout; or a rendezvous on a store that went away). A second close
        (`stop_all` at exit) does nothing: the clients it gave back may serve another group's watchdog now."""
        if self.closed:
            return False
        self.closed = True  # first: a later wait raises, instead of starting a monitor over dead heartbeats
        if self.broken is not None and self.watchdog.rank == 0:  # this process holds the group's store
            self.watchdog.linger(self.broken.ranks)
        self.watchdog.mark_closed()
        self.watchdog.close()
        self._monitor_stop.set()
        polling = self._monitor_thread is not None and self._monitor_thread is threading.current_thread()
        if self._monitor_thread is not None and not polling:
            self._monitor_thread.join(timeout=POLL + 5)
            polling = self._monitor_thread.is_alive()
        self._monitor_thread = None
        if self.broken is not None:
            self.abort()  # a helper thread may still be blocked in them
        self.abortables = []
        stuck = False
        if self._calls is not None:
            self._calls.put(None)  # an idle helper stops now, a blocked one once its call returns
            self._helper_thread.join(timeout=1 if self.broken is not None else 5)  # one left blocked cannot
            stuck = self._helper_thread.is_alive()  # be ended: it is a daemon
            if stuck:
                in_torch(self._helper_thread)
        self._calls = self._helper_thread = None
        if not polling:  # nothing of this group polls the store any more
            self.watchdog.give_back()
        return stuck


def _end(pg) -> None:
    """Shut a process group down for good (NCCL: abort its communicators; gloo: close its connections, which
    also ends a call blocked in one of them)."""
    kind = type(pg).__name__
    if kind == "ProcessGroup":  # torch.distributed's wrapper (the default group, `new_group`'s): by backend
        try:
            kind = dist.get_backend(pg)
        except Exception:  # noqa: BLE001 - no longer registered
            kind = ""
    name = "abort" if "nccl" in kind.lower() else "shutdown"
    try:
        getattr(pg, name)()
    except Exception:  # noqa: BLE001 - already ended, or a version without it: nothing more to do
        pass
