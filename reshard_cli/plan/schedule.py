"""The message schedule: which bytes travel in which message, in which order. Pure planning, no torch.

Both ends of every message compute it alike from the plan and the `TransferOptions`, so the options are part
of the schedule's input (never read from a process's environment): two ranks with different options would
post mismatched sends and receives.

Reshard path: the pieces between one sender and one receiver are packed into buckets of at most half the
staging budget (`bucket_bytes`), so two staging buffers let the next bucket be packed (or the previous one
unpacked) while the current one is on the wire. A piece of at least `direct_min_bytes` travels alone, straight
from the source tensor into the destination tensor where that end is contiguous; only a strided end copies.

Op order cannot deadlock: every message has a global key (phase, step, sender, receiver, bucket) known to
both ends, where step = (receiver index - sender index) mod M makes each step a matching between the groups;
each rank posts its sends and receives in key order. The smallest unfinished message then always has both
ends waiting on it, so it completes — at any scale.

Broadcast path: tensors with the same root are packed together, up to half a bucket per pack; one pack per
root is open at a time (tensors of one root need not be consecutive). The cost model counts packs with the
same `PackFiller`, so its prediction follows the transport.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from reshard_cli.plan.geometry import Box, is_contiguous_region
from reshard_cli.plan.planner import Bcast, Plan

ALIGN = 16  # byte alignment of every item inside a bucket or pack


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """What shapes the messages. Every rank of a refit must use the same values."""

    bucket_bytes: int = 64 << 20  # staging per rank: two buffers of half this
    direct_min_bytes: int = 64 << 10  # pieces this large travel alone where one end is contiguous
    window: int = 32  # messages in flight per rank (at most two of them staged)

    def __post_init__(self):
        if self.bucket_bytes <= 0 or self.direct_min_bytes < 0 or self.window < 1:
            raise ValueError(f"bad transfer options {self}")

    @property
    def half(self) -> int:
        """The largest bucket or pack."""
        return max(self.bucket_bytes // 2, ALIGN)


class Op(NamedTuple):
    """One message of this rank: its global key, direction, peer and the (tensor, box, byte offset) it carries."""

    key: tuple  # (phase, step, sender index, receiver index, bucket number)
    send: bool
    peer: int
    items: tuple  # ((tensor, box, byte offset in the bucket), ...)
    nbytes: int


@dataclass
class Pack:
    """Broadcast tensors of one root that travel as one broadcast."""

    root: int
    tensors: list  # [(Bcast, byte offset)]
    nbytes: int


class PackFiller:
    """The packing rule of the broadcast path: one open pack per root, closed when the next tensor would
    overflow half a bucket. `add` returns (pack, byte offset) with a pack number in order of first use."""

    def __init__(self, half: int):
        self.half = half
        self.count = 0
        self._open: dict[int, list] = {}  # root -> [pack number, bytes]

    def add(self, root: int, nbytes: int) -> tuple[int, int, bool]:
        """(pack number, offset, is_new) of a tensor of `nbytes` (aligned here) broadcast from `root`."""
        nb = align(nbytes)
        cur = self._open.get(root)
        if cur is not None and cur[1] + nb <= self.half:
            off = cur[1]
            cur[1] += nb
            return cur[0], off, False
        self._open[root] = [self.count, nb]
        self.count += 1
        return self.count - 1, 0, True


def rank_ops(plan: Plan, rank: int, options: TransferOptions, pieces=None) -> list[Op]:
    """This rank's reshard-path messages in global key order (`pieces` defaults to its rank view's)."""
    src_idx = {r: i for i, r in enumerate(plan.src.ranks)}
    dst_idx = {r: i for i, r in enumerate(plan.dst.ranks)}
    tensors = plan.src.manifest.tensors
    item = [s.itemsize for s in tensors]
    half = options.half
    by_peer: dict[tuple, list] = {}
    for p in (plan.rank_view(rank).pieces if pieces is None else pieces):
        send = p.src == rank
        peer = p.dst if send else p.src
        by_peer.setdefault((p.phase, send, peer), []).append((p.tensor, p.box))
    ops = []
    for (phase, send, peer), items in by_peer.items():
        s, d = (rank, peer) if send else (peer, rank)
        if phase == 0:
            si, di, m = src_idx.get(s, 0), dst_idx[d], max(len(src_idx), len(dst_idx))
        else:
            si, di, m = dst_idx[s], dst_idx[d], len(dst_idx)
        step = (di - si) % m
        items.sort(key=lambda x: (x[0], x[1].offsets))
        # Large pieces travel alone, straight from the source tensor into the destination tensor where
        # that end is contiguous; small ones are packed. Both ends decide alike from the plan.
        src_layout = plan.src if phase == 0 else plan.dst
        bucket: list = []
        size = end = n = 0  # next aligned offset; end of the last item (the message length); bucket no.
        for t, box in items:
            nb = box.numel * item[t]
            if nb >= options.direct_min_bytes:
                at_src = _contiguous(src_layout, s, tensors[t].shape, t, box)
                at_dst = _contiguous(plan.dst, d, tensors[t].shape, t, box)
                if at_src or at_dst:  # travels alone; only a strided end copies, half a bucket at a time
                    k = 1 if at_src and at_dst else -(-nb // half)
                    for b in (box.split(k) if k > 1 else [box]):
                        if b.numel:
                            ops.append(Op((phase, step, si, di, n), send, peer, ((t, b, 0),), b.numel * item[t]))
                            n += 1
                    continue
            k = -(-nb // half)  # a non-contiguous piece larger than a bucket is split (alike on both ends)
            for b in (box.split(k) if k > 1 else [box]):
                nb = b.numel * item[t]
                if not nb:
                    continue
                if bucket and size + nb > half:
                    ops.append(Op((phase, step, si, di, n), send, peer, tuple(bucket), end))
                    bucket, size, end, n = [], 0, 0, n + 1
                bucket.append((t, b, size))
                end = size + nb
                size = align(end)
        if bucket:
            ops.append(Op((phase, step, si, di, n), send, peer, tuple(bucket), end))
    ops.sort(key=lambda o: o.key)
    return ops


def _contiguous(layout, rank: int, shape: tuple, t: int, box: Box) -> bool:
    shard = layout.placements[t].box_of(shape, rank)
    return is_contiguous_region(Box(box.relative_to(shard), box.sizes), shard.sizes)


def packs(plan: Plan, options: TransferOptions, rank: int | None = None) -> list[Pack]:
    """Broadcast packs in the order they run (by first tensor), identical on every rank; with `rank`, only
    those it takes part in (as root, gather sender or destination)."""
    tensors = plan.src.manifest.tensors
    filler = PackFiller(options.half)
    out: list[Pack] = []
    for bc in plan.bcasts():
        if bc.root < 0:
            continue
        i, off, new = filler.add(bc.root, tensors[bc.tensor].nbytes)
        if new:
            out.append(Pack(bc.root, [], 0))
        out[i].tensors.append((bc, off))
        out[i].nbytes = off + align(tensors[bc.tensor].nbytes)
    if rank is None:
        return out
    is_dst = rank in plan.dst.ranks
    return [p for p in out if is_dst or p.root == rank
            or any(s == rank for bc, _ in p.tensors for s, _a in bc.gather)]


def broadcast_roots(plan: Plan) -> list[int]:
    """The roots of the broadcast path (one process group each), sorted."""
    return sorted({bc.root for bc in plan.bcasts() if bc.root >= 0})


__all__ = ["ALIGN", "align", "TransferOptions", "Op", "Pack", "PackFiller", "rank_ops", "packs", "broadcast_roots",
           "Bcast"]
