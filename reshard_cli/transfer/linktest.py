"""The link limit: a plan's own traffic as raw concurrent send/recv, with no packing and no phase order.

Every (sender, receiver) pair of the reshard path exchanges exactly the bytes the plan moves between them, all
messages posted at once (in chunks of at most `CHUNK` bytes) from one scratch buffer: nothing is copied. It
is the best this traffic pattern can do over this backend, so a refit's rate over it is the fraction of the
possible that the transport reaches. `reshard run` and `reshard bench` both measure it this way.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

CHUNK = 64 << 20  # largest single raw message


class LinkTest:
    """Collective: every rank of the world builds it from the same plan and calls `run_once` together."""

    def __init__(self, plan, pieces, rank: int, device: torch.device):
        """`pieces`: this rank's reshard-path pieces (its rank view's) of a plan."""
        tensors = plan.src.manifest.tensors
        per: dict[tuple[int, int], int] = defaultdict(int)
        for p in pieces:
            if p.src == rank or p.dst == rank:
                per[(p.src, p.dst)] += p.box.numel * tensors[p.tensor].itemsize
        self.rank = rank
        self.messages = sorted((k, v) for k, v in per.items() if v)  # ((sender, receiver), bytes), one order
        self.sent_bytes = sum(n for (s, _d), n in self.messages if s == rank)
        largest = min(max((n for _p, n in self.messages), default=0), CHUNK)
        self._sbuf = torch.empty(largest, dtype=torch.uint8, device=device)
        self._rbuf = torch.empty(largest, dtype=torch.uint8, device=device)

    def run_once(self) -> None:
        """Post every message at once, then wait for all."""
        works = []
        for (s, d), n in self.messages:
            for off in range(0, n, CHUNK):
                k = min(CHUNK, n - off)
                works.append(dist.isend(self._sbuf[:k], d) if s == self.rank else dist.irecv(self._rbuf[:k], s))
        for w in works:
            w.wait()


class CopyTest:
    """The copy limit of a memory transport for the same traffic: every rank copies the bytes it sends once and
    the bytes it receives once (a sender's pack and a receiver's take), in chunks of at most `CHUNK` bytes
    between two scratch buffers, all ranks at once. A transport through memory that copies each byte at both
    ends cannot beat it. Collective like `LinkTest`: every rank calls `run_once` together."""

    def __init__(self, link: LinkTest, device: torch.device):
        self.nbytes = sum(n for _pair, n in link.messages)  # sent and received by this rank
        largest = min(self.nbytes, CHUNK)
        self._a = torch.ones(largest, dtype=torch.uint8, device=device)  # touched: no page fault is timed
        self._b = torch.zeros(largest, dtype=torch.uint8, device=device)

    def run_once(self) -> None:
        for off in range(0, self.nbytes, CHUNK):
            k = min(CHUNK, self.nbytes - off)
            self._b[:k].copy_(self._a[:k])
