"""Executes a plan's message schedule over torch.distributed (gloo on CPU, NCCL on GPUs).

The schedule (`reshard_cli.plan.schedule`) says which bytes travel in which message and in which global
order (the deadlock-freedom argument is written there); this module moves them. Reshard path: up to
`window` messages in flight; packed messages take their space from one staging ring of `bucket_bytes`
(allocated once, at most what this rank's packed messages need, and kept across refits), freed in the order
the messages finish, so the next buckets are packed (or earlier ones unpacked) while others are on the wire.
A message that is one contiguous region at this end is sent from / received into the tensor itself, with no
copy. A forward is posted as soon as the message that brings its data has landed.

Broadcast path (the baseline RL frameworks use): for each pack the root gathers the other source shards,
assembles full tensors in the pack and broadcasts it to the whole destination group; each destination rank
copies out its slice. Its full-tensor buffers are its real memory cost and count as staging.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from reshard_cli.codecs import codec_for
from reshard_cli.plan import schedule
from reshard_cli.base.geometry import Box
from reshard_cli.plan.planner import Bcast, Plan
from reshard_cli.plan.schedule import TransferOptions
from reshard_cli.transfer.comm import WORLD
from reshard_cli.base.fragments import Fragments


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
        self.wire = self.plan.wire
        self.codec = codec_for(self.plan)  # what each item carries and how it lands (`codecs`)
        self.view = self.plan.rank_view(self.rank)
        self.ops = schedule.rank_ops(self.plan, self.rank, self.options, self.view.pieces)
        self.packs = schedule.packs(self.plan, self.options, self.rank)
        self._staging: list[torch.Tensor] = []  # broadcast path
        self._ring: _Ring | None = None  # reshard path
        self._views: dict = {}  # (0 src | 1 dst, tensor, box) -> view of a shard
        self._bound: tuple | None = None  # the shard dicts the views are of
        self._groups: dict[int, object] = {}
        self.peak_staging_bytes = 0
        self.bytes_sent = 0  # payload bytes (a bucket's alignment gaps are not counted)
        self.bytes_received = 0  # that arrived at this rank (into its buffers or staging; broadcast: whole packs)

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
            self.comm.release(self._staging[i])
            self._staging[i] = self.comm.staging(nbytes, self.device)
            self.peak_staging_bytes = max(self.peak_staging_bytes, sum(b.numel() for b in self._staging))
        return self._staging[i][:nbytes]

    def release_staging(self) -> None:
        """Drop the staging buffers (allocated again by the next run): a refit in groups holds one group's."""
        for buf in [*self._staging, *([self._ring.buf] if self._ring is not None else [])]:
            self.comm.release(buf)
        self._staging, self._ring = [], None

    def _slot(self, buf: torch.Tensor, t: int, box: Box, off: int) -> torch.Tensor:
        n = box.numel * self._item[t]
        return buf[off:off + n].view(self._dtype[t]).view(box.sizes)

    def _pack(self, buf: torch.Tensor, op, t: int, box: Box, off: int) -> None:
        """Copy an item into its place in an outgoing message: a forward from what landed here, a phase-0 send
        from the source (encoded here when the plan's codec says the item travels encoded)."""
        if not self.codec.encoded(t, box):
            read = self._dst_view if op.after is not None else self._src_view
            self._slot(buf, t, box, off).copy_(read(t, box))
        elif op.after is not None:
            self.codec.forward(buf, off, t, box, self.dst_shards[t])
        else:
            self.codec.encode(buf, off, t, box, self._src_view(t, box))

    def _unpack(self, buf: torch.Tensor, t: int, box: Box, off: int) -> None:
        if not self.codec.encoded(t, box):
            self._dst_view(t, box).copy_(self._slot(buf, t, box, off))
        else:
            self.codec.land(buf, off, t, box, self.dst_shards.get(t))

    def _src_view(self, t: int, box: Box) -> torch.Tensor:
        sh = self.src_shards[t]
        if isinstance(sh.data, Fragments):  # assembled from the current values on every read: never cached
            return sh.read(box)
        v = self._views.get((0, t, box))
        if v is None:
            v = self._views[(0, t, box)] = sh.read(box)
        return v

    def _dst_view(self, t: int, box: Box) -> torch.Tensor:
        v = self._views.get((1, t, box))
        if v is None:
            sh = self.dst_shards[t]
            v = self._views[(1, t, box)] = sh.data[box.local_slices(sh.box)]
        return v

    def unbind_destination(self) -> None:
        """Forget the destination buffers (an engine's staging group, done): the next run needs new ones."""
        self.dst_shards = {}
        self._views.clear()
        self._bound = None

    def _fresh_views(self) -> None:
        """Views are kept between refits while the shards are the same objects (a rebind drops them)."""
        bound = (self.src_shards, self.dst_shards)
        if self._bound is None or any(a is not b for a, b in zip(bound, self._bound)):
            self._views.clear()
            self._bound = bound

    # ------------------------------------------------------------------------------------ reshard path

    def _direct(self, op) -> torch.Tensor | None:
        """The tensor region a one-item message is sent from / received into when it is contiguous here."""
        if len(op.items) != 1:
            return None
        t, box, _ = op.items[0]
        if self.codec.encoded(t, box):  # encoded on the way: always through a message buffer
            return None
        if op.send and self.comm.one_sided_with(op.peer):  # its receiver reads the staging: packed there
            return None
        # a forward reads what this rank received; a phase-0 send reads the source
        v = (self._dst_view if op.after is not None or not op.send else self._src_view)(t, box)
        return v if v.is_contiguous() else None

    def _taken(self, op) -> bool:
        """A received message a one-sided transport lets this rank unpack where its sender left it."""
        return not op.send and self.comm.one_sided_with(op.peer) and self._direct(op) is None

    def _staging_ring(self) -> "_Ring":
        if self._ring is None:
            need = sum(schedule.align(op.nbytes) for op in self.ops if self._direct(op) is None and not self._taken(op))
            cap = max(min(need, self.options.bucket_bytes), schedule.ALIGN)
            self._ring = _Ring(self.comm.staging(cap, self.device))
            self.peak_staging_bytes = max(self.peak_staging_bytes,
                                          cap + sum(b.numel() for b in self._staging))
        return self._ring

    def run_reshard(self) -> None:
        if not self.ops:
            return
        self._fresh_views()
        ring = self._staging_ring()
        pending: deque = deque()
        window = self.options.window
        for op in self.ops:
            if op.after is not None:  # a forward: the message that brings its data must have landed
                while pending and pending[0][1].key <= op.after:
                    self._finish(pending.popleft(), ring)
            direct = self._direct(op)
            while len(pending) >= window:
                self._finish(pending.popleft(), ring)
            if direct is not None:
                tensor, staged = direct, _DIRECT
            elif self._taken(op):  # unpacked from where its sender left it
                pending.append((self.comm.itake(op.nbytes, op.peer, partial(self._unpack_all, op)), op, None, _TAKEN))
                continue
            else:
                if schedule.align(op.nbytes) > ring.cap:  # planned as direct, but this tensor is strided here
                    tensor, staged = torch.empty(op.nbytes, dtype=torch.uint8, device=self.device), _TEMP
                    self.peak_staging_bytes = max(self.peak_staging_bytes, ring.cap + op.nbytes)
                else:
                    while (off := ring.alloc(op.nbytes)) is None:
                        self._finish(pending.popleft(), ring)
                    tensor, staged = ring.buf[off:off + op.nbytes], _RING
                if op.send:
                    for t, box, o in op.items:
                        self._pack(tensor, op, t, box, o)
            work = self.comm.isend(tensor, op.peer) if op.send else self.comm.irecv(tensor, op.peer)
            pending.append((work, op, tensor, staged))
        while pending:
            self._finish(pending.popleft(), ring)

    def _unpack_all(self, op, buf: torch.Tensor) -> None:
        for t, box, off in op.items:
            self._unpack(buf, t, box, off)

    def _finish(self, entry, ring: "_Ring") -> None:
        work, op, tensor, staged = entry
        work.wait()
        if not op.send and staged not in (_DIRECT, _TAKEN):
            self._unpack_all(op, tensor)
        if staged == _RING:
            ring.free()
        payload = sum(self.wire.payload(t, box) for t, box, _ in op.items)  # the bucket's alignment gaps aside
        if not op.send:
            self.bytes_received += payload
        if op.send:
            self.bytes_sent += payload
            if self.progress:
                self.progress(payload)

    # ------------------------------------------------------------------------------ after the messages

    def finish_received(self) -> int:
        """Once every message landed here: what the plan's codec does with complete boxes only (into a quantized
        engine: the blocks that arrived in the source's dtype, converted into its storage). Returns the elements
        converted here."""
        if not self.codec.converts or self.rank not in self.plan.dst.ranks:
            return 0
        received = [(t, box) for op in self.ops if not op.send for t, box, _off in op.items]
        whole = [bc.tensor for pack in self.packs for bc, _off in pack.tensors]
        return self.codec.finish(received, whole, self.dst_shards)

    # ---------------------------------------------------------------------------------- broadcast path

    def run_broadcast(self) -> None:
        self._fresh_views()
        for pack in self.packs:
            is_root = pack.root == self.rank
            buf = self._buffer(0, pack.nbytes) if (is_root or self.rank in self.plan.dst.ranks) else None
            for bc, off in pack.tensors:  # gather on the root, tensor by tensor, in pack order
                self._gather(bc, buf, off)
            if buf is not None:
                self.comm.broadcast(buf, pack.root, self._groups[pack.root])
                payload = sum(self.plan.src.manifest.tensors[bc.tensor].nbytes for bc, _ in pack.tensors)
                if is_root:
                    self.bytes_sent += payload
                    if self.progress:
                        self.progress(payload)
                else:
                    self.bytes_received += payload
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
                self.bytes_received += a.numel * self._item[t]
        else:
            for s, a in bc.gather:
                if s == self.rank:
                    self.comm.isend(self._src_view(t, a).contiguous(), bc.root).wait()
                    self.bytes_sent += a.numel * self._item[t]


_DIRECT, _RING, _TEMP, _TAKEN = 0, 1, 2, 3  # where a message's bytes are: the tensor itself, the staging ring, a
# temporary, the sender's memory (unpacked from there by a one-sided transport)


class _Ring:
    """The reshard path's staging: one buffer handed out in FIFO order (messages finish in the order they
    were posted, so space frees from the oldest end)."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.cap = buf.numel()
        self.live: deque = deque()  # (start, end) of the regions in use, oldest first

    def alloc(self, nbytes: int) -> int | None:
        """Offset of `nbytes` free bytes, or None until the oldest region is freed."""
        n = schedule.align(nbytes)
        if not self.live:
            start = 0 if n <= self.cap else None
        else:
            tail, head = self.live[0][0], self.live[-1][1]
            if head > tail:  # in use: [tail, head)
                start = head if head + n <= self.cap else (0 if n <= tail else None)
            else:  # wrapped: in use [tail, cap) and [0, head)
                start = head if head + n <= tail else None
        if start is not None:
            self.live.append((start, start + n))
        return start

    def free(self) -> None:
        self.live.popleft()
