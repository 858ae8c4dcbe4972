"""The message schedule: which bytes travel in which message, in which order. Pure planning, no torch.

Both ends of every message compute it alike from the plan and the `TransferOptions`, so the options are part
of the schedule's input (never read from a process's environment): two ranks with different options would
post mismatched sends and receives.

Reshard path: the pieces between one sender and one receiver travel in as few messages as the staging budget
allows: packed into buckets of at most half of `bucket_bytes`, one message per bucket. A piece of at least
`direct_min_bytes` that is one contiguous run at either end travels alone, straight from the source tensor or
into the destination tensor, so that end copies nothing (a strided end packs or unpacks it, half a bucket at a
time). Staging is one ring of `bucket_bytes` per rank: as many packed messages are in flight as fit in it.

Forwarding (phase 1) is pipelined per bucket: a destination rank that received a phase-0 message M whose
items its domain peers also need forwards those items to each peer g in one message as soon as M has landed.
Both ends derive that message from M (the receiver g rebuilds its forwarder's phase-0 messages from the
plan), so it needs no handshake.

Op order cannot deadlock: every message has a global key (step, sender index, receiver index, bucket, slot)
known to both ends. For a phase-0 message step = (receiver index - sender index) mod M makes each step a
matching between the groups, and slot = 0; the forward of M to peer g has M's key with slot = 1 + g's index,
so it follows M. Each rank posts its sends and receives in key order, and waits only for messages with
smaller keys (a full window or staging ring waits for its oldest message; a forward waits for the M that
brings its data). So the smallest unfinished message always has both ends posted and waiting on it, and it
completes — at any scale. Both ends of every pair see its messages in the same (key) order, which is all the
per-pair FIFO matching of gloo and NCCL point-to-point needs.

Broadcast path: tensors with the same root are packed together, up to half a bucket per pack; one pack per
root is open at a time (tensors of one root need not be consecutive). The cost model counts packs with the
same `PackFiller`, so its prediction follows the transport.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from reshard_cli.base.geometry import Box, is_contiguous_region
from reshard_cli.plan.terms import Bcast

if TYPE_CHECKING:  # the plan the cost model and the schedule read (`Plan` chooses its routes with
    from reshard_cli.plan.planner import Plan  # `auto_routes`: imported here for annotations only)

ALIGN = 16  # byte alignment of every item inside a bucket or pack


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """What shapes the messages. Every rank of a refit must use the same values."""

    bucket_bytes: int = 64 << 20  # staging per rank (one ring); a bucket is at most half of it
    direct_min_bytes: int = 1 << 20  # pieces this large travel alone where one end is contiguous
    window: int = 32  # messages in flight per rank (packed ones as many as fit in the staging ring)

    def __post_init__(self):
        if self.bucket_bytes <= 0 or self.direct_min_bytes < 0 or self.window < 1:
            raise ValueError(f"bad transfer options {self}")

    @property
    def half(self) -> int:
        """The largest bucket or pack."""
        return max(self.bucket_bytes // 2, ALIGN)


class Op(NamedTuple):
    """One message of this rank: its global key, direction, peer and the (tensor, box, byte offset) it carries."""

    key: tuple  # (step, sender index, receiver index, bucket number, slot): see the module docstring
    send: bool
    peer: int
    items: tuple  # ((tensor, box, byte offset in the bucket), ...)
    nbytes: int
    after: tuple | None = None  # a forward this rank sends: the key of the message that brings its data


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
    pieces = plan.rank_view(rank).pieces if pieces is None else pieces
    sched = _PairSchedule(plan, options)
    direct: dict[tuple, list] = {}  # (send, peer) -> phase-0 items
    fwd_out: dict[tuple, list[int]] = {}  # (tensor, box) this rank forwards -> the peers it goes to
    fwd_in: dict[int, set] = {}  # forwarder -> the (tensor, box) it forwards to this rank
    for p in pieces:
        if p.phase == 0:
            send = p.src == rank
            direct.setdefault((send, p.dst if send else p.src), []).append((p.tensor, p.box))
        elif p.src == rank:
            fwd_out.setdefault((p.tensor, p.box), []).append(p.dst)
        else:
            fwd_in.setdefault(p.src, set()).add((p.tensor, p.box))
    ops = []
    for (send, peer), items in direct.items():
        s, d = (rank, peer) if send else (peer, rank)
        for key, its, nbytes, whole in sched.messages(s, d, items):
            ops.append(Op(key, send, peer, its, nbytes))
            if not send and fwd_out:  # forward what the domain peers need of it, as soon as it lands
                by_peer: dict[int, list] = {}
                for (t, box, _off), piece in zip(its, whole):
                    for g in fwd_out.get((t, piece), ()):
                        by_peer.setdefault(g, []).append((t, box))
                for g, fw in by_peer.items():
                    packed, n = sched.pack(fw)
                    ops.append(Op(key[:4] + (1 + sched.dst_idx[g],), True, g, packed, n, key))
    me = sched.dst_idx.get(rank)
    for d, wanted in fwd_in.items():  # the forwards this rank receives: rebuilt from d's phase-0 messages
        inbound: dict[int, list] = {}
        for p in plan.rank_view(d).pieces:
            if p.phase == 0 and p.dst == d:
                inbound.setdefault(p.src, []).append((p.tensor, p.box))
        for s, items in inbound.items():
            for key, its, _n, whole in sched.messages(s, d, items):
                fw = [(t, box) for (t, box, _off), piece in zip(its, whole) if (t, piece) in wanted]
                if fw:
                    packed, n = sched.pack(fw)
                    ops.append(Op(key[:4] + (1 + me,), False, d, packed, n))
    ops.sort(key=lambda o: o.key)
    return ops


class _PairSchedule:
    """The phase-0 messages between one sender and one receiver, computed alike on both ends."""

    def __init__(self, plan: Plan, options: TransferOptions):
        self.plan, self.options = plan, options
        self.src_idx = {r: i for i, r in enumerate(plan.src.ranks)}
        self.dst_idx = {r: i for i, r in enumerate(plan.dst.ranks)}
        self.m = max(len(self.src_idx), len(self.dst_idx))
        self.tensors = plan.src.manifest.tensors

    def messages(self, s: int, d: int, items: list) -> list[tuple]:
        """[(key, ((tensor, box, offset), ...), nbytes, (the piece each item is part of, ...))] of the pair
        s -> d, in bucket order (a piece larger than a bucket travels in parts; into a block-FP8 engine a
        piece travels as its quantized whole blocks and its rim, `plan.wire`)."""
        plan, opts, tensors = self.plan, self.options, self.tensors
        si, di = self.src_idx[s], self.dst_idx[d]
        step = (di - si) % self.m
        half = opts.half
        out: list[tuple] = []
        bucket: list = []
        whole: list = []
        size = end = 0  # next aligned offset; end of the last item (the message length)
        wire = plan.wire
        for t, piece in sorted(items, key=lambda x: (x[0], x[1].offsets)):
            for box in wire.parts(t, piece):  # into an FP8 engine: its whole blocks quantized, the rim not
                nb = wire.nbytes(t, box)
                if nb >= opts.direct_min_bytes and not wire.fp8(t, box):
                    at_src = _contiguous(plan.src, s, tensors[t].shape, t, box)
                    at_dst = _contiguous(plan.dst, d, tensors[t].shape, t, box)
                    if at_src or at_dst:  # travels alone; only a strided end copies, half a bucket at a time
                        k = 1 if at_src and at_dst else -(-nb // half)
                        out.extend((((t, b, 0),), wire.nbytes(t, b), (piece,))
                                   for b in (wire.split(t, box, k) if k > 1 else [box]) if b.numel)
                        continue
                k = -(-nb // half)  # a part larger than a bucket is split (alike on both ends)
                for b in (wire.split(t, box, k) if k > 1 else [box]):
                    nb = wire.nbytes(t, b)
                    if not nb:
                        continue
                    if bucket and size + nb > half:
                        out.append((tuple(bucket), end, tuple(whole)))
                        bucket, whole, size, end = [], [], 0, 0
                    bucket.append((t, b, size))
                    whole.append(piece)
                    end = size + nb
                    size = align(end)
        if bucket:
            out.append((tuple(bucket), end, tuple(whole)))
        return [((step, si, di, n, 0), its, nbytes, wh) for n, (its, nbytes, wh) in enumerate(out)]

    def pack(self, items: list) -> tuple[tuple, int]:
        """Items laid out one after another (aligned): ((tensor, box, offset), ...) and the message length."""
        out, size, end = [], 0, 0
        for t, box in items:
            out.append((t, box, size))
            end = size + self.plan.wire.nbytes(t, box)
            size = align(end)
        return tuple(out), end


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
