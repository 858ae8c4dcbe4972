"""Executes a plan's message schedule over torch.distributed (gloo on CPU, NCCL on GPUs).

The schedule (`reshard_cli.plan.schedule`) says which bytes travel in which message and in which global
order (the deadlock-freedom argument is written there); this module moves them. Reshard path: up to
`window` messages in flight, two staging buffers (the next bucket is packed, or the previous one unpacked,
while the current one is on the wire); a message that is one contiguous region at this end is sent from /
received into the tensor itself, with no copy.

Broadcast path (the baseline RL frameworks use): for each pack the root gathers the other source shards,
assembles full tensors in the pack and broadcasts it to the whole destination group; each destination rank
copies out its slice. Its full-tensor buffers are its real memory cost and count as staging.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from reshard_cli.plan import schedule
from reshard_cli.plan.geometry import Box
from reshard_cli.plan.planner import Bcast, Plan
from reshard_cli.plan.schedule import TransferOptions
from reshard_cli.transfer.comm import WORLD


@dataclass
class Engine:
    """One rank's part of a refit: its source shards, its destination buffers and its schedule."""

    plan: Plan
    rank: int
    src_shards: dict  # tensor index -> LocalShard (this rank's source data)
    dst_shards: dict  # tensor index -> LocalShard (this rank's destination buffers, written in place)
    options: TransferOptions = field(default_factory=TransferOptions)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    progress: Callable[[int], None] | None = None
    comm: object = WORLD  # who carries the bytes (transfer.comm): the default group or a refit group

    def __post_init__(self):
        man = self.plan.src.manifest.tensors
        self._item = [s.itemsize for s in man]
        self._dtype = [getattr(torch, s.dtype) for s in man]
        self.view = self.plan.rank_view(self.rank)
        self.ops = schedule.rank_ops(self.plan, self.rank, self.options, self.view.pieces)
        self.packs = schedule.packs(self.plan, self.options, self.rank)
        self._staging: list[torch.Tensor] = []
        self._groups: dict[int, object] = {}
        self.peak_staging_bytes = 0
        self.bytes_sent = 0
        self.bytes_received = 0  # reshard path: bytes that arrived at this rank (into its buffers or staging)

    # ------------------------------------------------------------------------------------------ groups

    def setup_groups(self) -> None:
        """Create one broadcast group per root. Collective: every rank of the world calls it, same order."""
        for root in schedule.broadcast_roots(self.plan):
            ranks = sorted({root, *self.plan.dst.ranks})
            g = self.comm.new_group(ranks)
            if self.rank in ranks:
                self._groups[root] = g

    # -------------------------------------------------------------------------------------------- staging

    def _buffer(self, i: int, nbytes: int) -> torch.Tensor:
        while len(self._staging) <= i:
            self._staging.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._staging[i].numel() < nbytes:
            self._staging[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.peak_staging_bytes = max(self.peak_staging_bytes, sum(b.numel() for b in self._staging))
        return self._staging[i][:nbytes]

    def _slot(self, buf: torch.Tensor, t: int, box: Box, off: int) -> torch.Tensor:
        n = box.numel * self._item[t]
        return buf[off:off + n].view(self._dtype[t]).view(box.sizes)

    def _src_view(self, t: int, box: Box) -> torch.Tensor:
        return self.src_shards[t].read(box)

    def _dst_view(self, t: int, box: Box) -> torch.Tensor:
        sh = self.dst_shards[t]
        return sh.data[box.local_slices(sh.box)]

    # ------------------------------------------------------------------------------------ reshard path

    def run_reshard(self) -> None:
        pending: deque = deque()
        free = [0, 1]
        phase = 0
        for op in self.ops:
            if op.key[0] != phase:  # phase 1 forwards phase-0 data: everything received must have landed
                while pending:
                    self._finish(pending.popleft(), free)
                phase = op.key[0]
            # phase 1 forwards what this destination rank received in phase 0
            read = self._src_view if phase == 0 else self._dst_view
            direct = None
            if len(op.items) == 1:
                t, box, _ = op.items[0]
                v = read(t, box) if op.send else self._dst_view(t, box)
                if v.is_contiguous():
                    direct = v
            while len(pending) >= self.options.window or (direct is None and not free):
                self._finish(pending.popleft(), free)
            if direct is not None:
                tensor, slot = direct, None
            else:
                slot = free.pop()
                tensor = self._buffer(slot, op.nbytes)
                if op.send:
                    for t, box, off in op.items:
                        self._slot(tensor, t, box, off).copy_(read(t, box))
            work = self.comm.isend(tensor, op.peer) if op.send else self.comm.irecv(tensor, op.peer)
            pending.append((work, op, tensor, slot))
        while pending:
            self._finish(pending.popleft(), free)

    def _finish(self, entry, free: list) -> None:
        work, op, tensor, slot = entry
        work.wait()
        if not op.send and slot is not None:
            for t, box, off in op.items:
                self._dst_view(t, box).copy_(self._slot(tensor, t, box, off))
        if slot is not None:
            free.append(slot)
        if not op.send:
            self.bytes_received += op.nbytes
        if op.send:
            self.bytes_sent += op.nbytes
            if self.progress:
                self.progress(op.nbytes)

    # ---------------------------------------------------------------------------------- broadcast path

    def run_broadcast(self) -> None:
        for pack in self.packs:
            is_root = pack.root == self.rank
            buf = self._buffer(0, pack.nbytes) if (is_root or self.rank in self.plan.dst.ranks) else None
            for bc, off in pack.tensors:  # gather on the root, tensor by tensor, in pack order
                self._gather(bc, buf, off)
            if buf is not None:
                self.comm.broadcast(buf, pack.root, self._groups[pack.root])
                if is_root:
                    self.bytes_sent += pack.nbytes
                    if self.progress:
                        self.progress(pack.nbytes)
            if self.rank in self.plan.dst.ranks:
                for bc, off in pack.tensors:
                    sh = self.dst_shards.get(bc.tensor)
                    if sh is not None and sh.box.numel:
                        full = self._full(buf, bc.tensor, off)
                        sh.data.copy_(full[sh.box.slices()])

    def _full(self, buf: torch.Tensor, t: int, off: int) -> torch.Tensor:
        shape = self.plan.src.manifest.tensors[t].shape
        return self._slot(buf, t, Box.full(shape), off)

    def _gather(self, bc: Bcast, buf: torch.Tensor | None, off: int) -> None:
        t = bc.tensor
        if bc.root == self.rank:
            full = self._full(buf, t, off)
            full[bc.root_box.slices()].copy_(self._src_view(t, bc.root_box))
            for s, a in bc.gather:
                region = full[a.slices()]
                if region.is_contiguous():
                    self.comm.irecv(region, s).wait()
                else:
                    tmp = torch.empty(a.sizes, dtype=region.dtype, device=self.device)
                    self.comm.irecv(tmp, s).wait()
                    region.copy_(tmp)
        else:
            for s, a in bc.gather:
                if s == self.rank:
                    self.comm.isend(self._src_view(t, a).contiguous(), bc.root).wait()
