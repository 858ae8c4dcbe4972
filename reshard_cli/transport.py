"""Executes a plan over torch.distributed (gloo on CPU, NCCL on GPUs).

Reshard path: the pieces between one sender and one receiver are packed into buckets of at most half the
staging budget (`bucket_bytes`); two staging buffers let the next bucket be packed (or the previous one
unpacked) while the current one is on the wire. A bucket that is one contiguous piece is sent from / received
into the tensor itself, with no copy.

Op order cannot deadlock: every message has a global key (phase, step, sender, receiver, bucket) known to
both ends, where step = (receiver index - sender index) mod M makes each step a matching between the groups;
each rank posts its sends and receives in key order. The smallest unfinished message then always has both
ends waiting on it, so it completes — at any scale.

Broadcast path (the baseline RL frameworks use): tensors with the same root are packed together; the
root gathers the other source shards, assembles full tensors in the pack, and broadcasts the pack to the
whole destination group; each destination rank copies out its slice. Its full-tensor buffers are its real
memory cost and count as staging.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from reshard_cli.geometry import Box, is_contiguous_region
from reshard_cli.plan import Bcast, Plan

ALIGN = 16


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Op(NamedTuple):
    key: tuple
    send: bool
    peer: int
    items: tuple  # ((tensor, box, byte offset in bucket), ...)
    nbytes: int


@dataclass
class Pack:
    root: int
    tensors: list  # [(Bcast, byte offset)]
    nbytes: int


@dataclass
class Shard:
    """A rank's local shard of one tensor: the global box it covers and its data."""

    box: Box
    data: torch.Tensor


@dataclass
class Engine:
    plan: Plan
    rank: int
    src_shards: dict  # tensor index -> Shard (this rank's source data)
    dst_shards: dict  # tensor index -> Shard (this rank's destination buffers, written in place)
    bucket_bytes: int = 64 << 20
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    progress: Callable[[int], None] | None = None
    direct_min_bytes: int = int(os.environ.get("RESHARD_DIRECT_MIN", 64 << 10))  # pieces this big travel alone
    window: int = 32  # messages in flight per rank (at most two of them staged)

    def __post_init__(self):
        man = self.plan.src.manifest.tensors
        self._item = [s.nbytes // s.numel if s.numel else 1 for s in man]
        self._dtype = [getattr(torch, s.dtype) for s in man]
        self.view = self.plan.rank_view(self.rank)
        self.ops = self._build_ops()
        self.packs = self._build_packs()
        self._staging: list[torch.Tensor] = []
        self._groups: dict[int, object] = {}
        self.peak_staging_bytes = 0
        self.bytes_sent = 0

    # ------------------------------------------------------------------------------------------ planning

    def _build_ops(self) -> list[Op]:
        src_idx = {r: i for i, r in enumerate(self.plan.src.ranks)}
        dst_idx = {r: i for i, r in enumerate(self.plan.dst.ranks)}
        half = max(self.bucket_bytes // 2, ALIGN)
        by_peer: dict[tuple, list] = {}
        for p in self.view.pieces:
            send = p.src == self.rank
            peer = p.dst if send else p.src
            by_peer.setdefault((p.phase, send, peer), []).append((p.tensor, p.box))
        ops = []
        for (phase, send, peer), items in by_peer.items():
            s, d = (self.rank, peer) if send else (peer, self.rank)
            if phase == 0:
                si, di, m = src_idx.get(s, 0), dst_idx[d], max(len(src_idx), len(dst_idx))
            else:
                si, di, m = dst_idx[s], dst_idx[d], len(dst_idx)
            step = (di - si) % m
            items.sort(key=lambda x: (x[0], x[1].offsets))
            # Large pieces travel alone, straight from the source tensor into the destination tensor where
            # that end is contiguous; small ones are packed. Both ends decide alike from the plan.
            src_layout = self.plan.src if phase == 0 else self.plan.dst
            bucket: list = []
            size = end = n = 0  # next aligned offset; end of the last item (the message length); bucket no.
            for t, box in items:
                nb = box.numel * self._item[t]
                if nb >= self.direct_min_bytes:
                    at_src = self._contiguous(src_layout, s, t, box)
                    at_dst = self._contiguous(self.plan.dst, d, t, box)
                    if at_src or at_dst:  # travels alone; only a strided end copies, half a bucket at a time
                        k = 1 if at_src and at_dst else -(-nb // half)
                        for b in (box.split(k) if k > 1 else [box]):
                            if b.numel:
                                ops.append(Op((phase, step, si, di, n), send, peer, ((t, b, 0),),
                                              b.numel * self._item[t]))
                                n += 1
                        continue
                k = -(-nb // half)  # a non-contiguous piece larger than a bucket is split (alike on both ends)
                for b in (box.split(k) if k > 1 else [box]):
                    nb = b.numel * self._item[t]
                    if not nb:
                        continue
                    if bucket and size + nb > half:
                        ops.append(Op((phase, step, si, di, n), send, peer, tuple(bucket), end))
                        bucket, size, end, n = [], 0, 0, n + 1
                    bucket.append((t, b, size))
                    end = size + nb
                    size = _align(end)
            if bucket:
                ops.append(Op((phase, step, si, di, n), send, peer, tuple(bucket), end))
        ops.sort(key=lambda o: o.key)
        return ops

    def _contiguous(self, layout, rank: int, t: int, box: Box) -> bool:
        shape = self.plan.src.manifest.tensors[t].shape
        shard = layout.placements[t].box_of(shape, rank)
        return is_contiguous_region(Box(box.relative_to(shard), box.sizes), shard.sizes)

    def _build_packs(self) -> list[Pack]:
        """Broadcast packs, identical on every rank: tensors with one root, up to half a bucket each."""
        half = max(self.bucket_bytes // 2, ALIGN)
        man = self.plan.src.manifest.tensors
        packs: list[Pack] = []
        open_packs: dict[int, Pack] = {}  # one filling pack per root: tensors need not be consecutive
        for bc in self.plan.bcasts():
            if bc.root < 0:
                continue
            nb = _align(man[bc.tensor].nbytes)
            last = open_packs.get(bc.root)
            if last is not None and last.nbytes + nb <= half:
                last.tensors.append((bc, last.nbytes))
                last.nbytes += nb
            else:
                open_packs[bc.root] = Pack(bc.root, [(bc, 0)], nb)
                packs.append(open_packs[bc.root])  # packs run in order of their first tensor
        mine = self.rank in self.plan.dst.ranks
        return [p for p in packs if mine or p.root == self.rank
                or any(s == self.rank for bc, _ in p.tensors for s, _a in bc.gather)]

    def setup_groups(self) -> None:
        """Create one broadcast group per root. Collective: every rank of the world calls it, same order."""
        roots = sorted({bc.root for bc in self.plan.bcasts() if bc.root >= 0})
        for root in roots:
            ranks = sorted({root, *self.plan.dst.ranks})
            g = dist.new_group(ranks)
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
        sh = self.src_shards[t]
        return sh.data[box.local_slices(sh.box)]

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
            while len(pending) >= self.window or (direct is None and not free):
                self._finish(pending.popleft(), free)
            if direct is not None:
                tensor, slot = direct, None
            else:
                slot = free.pop()
                tensor = self._buffer(slot, op.nbytes)
                if op.send:
                    for t, box, off in op.items:
                        self._slot(tensor, t, box, off).copy_(read(t, box))
            work = dist.isend(tensor, op.peer) if op.send else dist.irecv(tensor, op.peer)
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
                dist.broadcast(buf, src=pack.root, group=self._groups[pack.root])
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
                    dist.recv(region, s)
                else:
                    tmp = torch.empty(a.sizes, dtype=region.dtype, device=self.device)
                    dist.recv(tmp, s)
                    region.copy_(tmp)
        else:
            for s, a in bc.gather:
                if s == self.rank:
                    dist.send(self._src_view(t, a).contiguous(), bc.root)
