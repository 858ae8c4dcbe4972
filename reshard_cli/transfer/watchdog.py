"""Naming the rank that failed, died or stalled, on every other rank of a refit group, quickly.

A collective or a message blocked on a peer that will never answer waits for the group's timeout in gloo (and
then says only "Connection closed by peer [ip]:port" or "Timed out waiting"); a rank that raised leaves its
peers waiting for bytes that will not come. So a refit group carries a watchdog over its own TCP store:

  heartbeat   every rank's daemon thread adds 1 to `hb/<rank>` every `interval` seconds. A process that is
              stopped (SIGSTOP), killed, or hung with the interpreter locked stops counting.
  faults      a rank that fails on its own (an exception mid-transfer) writes its one-line error under
              `fault/<n>` before it gives up; so does a rank that found a stalled peer.
  waits       every wait on the group's traffic runs on a helper thread while the caller polls the store
              (`check`) twice a second: the first reported fault, or a peer whose count has not moved for
              `stall` seconds, ends the wait with that line (`GroupBroken`). A transport error (a dead peer's
              closed connection) is explained the same way: the peer whose count stopped within a few
              seconds is named, not the socket. The store itself lives in refit rank 0's process: when it is
              gone, that rank is named.

After a `GroupBroken` the group is not used again (its helper thread may stay blocked in the transport until
the group's timeout, then ends); the next refit joins a new group.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from reshard_cli.errors import RuntimeFailure

POLL = 0.5  # seconds between two looks at the store while a wait is blocked
DEATH_WINDOW = 3.0  # after a transport error: how long a peer's silent heartbeat takes to say it died


class GroupBroken(RuntimeFailure):
    """A refit group's peer failed, died or stalled; the group cannot carry another byte."""


class Watchdog:
    def __init__(self, store, rank: int, size: int, *, interval: float = 1.0, stall: float = 30.0):
        self.store = dist.PrefixStore("reshard-watch", store)
        self.rank, self.size, self.interval, self.stall = rank, size, interval, stall
        self.roles: list[str] = [""] * size  # what each rank is, once the group knows ("trainer 0")
        now = time.monotonic()
        self._seen = {r: (None, now) for r in range(size) if r != rank}  # rank -> (count, when it last moved)
        self._stop = threading.Event()
        self.store.add(f"hb/{rank}", 1)  # before the check-in: every key exists once the group has formed
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name=f"reshard-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"hb/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 died): the waits name it
                return

    def close(self) -> None:
        self._stop.set()

    def who(self, rank: int) -> str:
        role = self.roles[rank] if rank < len(self.roles) else ""
        return f"refit rank {rank}" + (f" ({role})" if role else "")

    def report(self, line: str) -> None:
        """Tell every rank of the group this fault (the first one reported is the one every rank names)."""
        try:
            n = self.store.add("faults", 1)
            self.store.set(f"fault/{n}", line)
        except Exception:  # noqa: BLE001 - no store: the others find out from it being gone
            pass

    def check(self, stall: float | None = None) -> str | None:
        """The line of the first fault reported, or of the peers silent for `stall` seconds; None if all is well."""
        try:
            if self.store.add("faults", 0):
                self.store.wait(["fault/1"], timedelta(seconds=5))
                return self.store.get("fault/1").decode()
            peers = sorted(self._seen)
            counts = self.store.multi_get([f"hb/{r}" for r in peers])
        except Exception:  # noqa: BLE001 - TCPStore's errors differ by version; any means its server is gone
            return (f"{self.who(0)} stopped answering: the refit group's store, which that rank holds, is gone "
                    f"(it died or its host is unreachable)")
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
        return f"{names} stopped answering: no heartbeat for {longest:.0f} s (the process died or is stalled)"

    def cause(self, error: BaseException) -> str:
        """Why a transport operation failed: a reported fault, or the peer that stopped within DEATH_WINDOW
        seconds; else the error itself, as this rank's."""
        deadline = time.monotonic() + DEATH_WINDOW + 2 * self.interval
        while time.monotonic() < deadline:
            line = self.check(stall=DEATH_WINDOW)
            if line:
                return line
            time.sleep(POLL / 2)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"{self.who(self.rank)}: transport error ({first})"
