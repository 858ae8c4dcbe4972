"""Checksums against the plan: what each source rank contributes to every destination box, and the
collective comparison of what landed with what was sent (the formula: `base.checksums`).

Into a block-FP8 engine a destination's checksum covers what it stores: its FP8 bytes and scales, and the
source's bytes of the parts that arrived unquantized (blocks a source shard boundary cuts, which it quantized
itself once complete). The sources compute the same: the blocks their shard holds whole they quantize as they
send them; for a block several shards share, the ranks first agree on its max |x| (`cut_block_amax`, each over
its part), from which each quantizes its own part to the bytes the destination must hold, and one part (the
one holding the block's first element) speaks for its scale. So a wrong quantization on the destination, or a
byte of its storage changed afterwards, is named like a byte that never arrived.
"""
from __future__ import annotations

import itertools

from reshard_cli.base.blocks import blocks_of, scale_offset, split_whole
from reshard_cli.base.checksums import checksum, combine
from reshard_cli.base.geometry import Box


def cut_block_amax(plan, rank: int, src_shards: dict) -> dict:
    """This source rank's part of each block of a block-FP8 engine's weight that a source shard boundary cuts:
    (tensor, block index) -> max |x| over the part it holds (the first replica of each unique source box
    speaks for it). `merge_amax` of every rank's is each such block's max |x|."""
    from reshard_cli.base.fp8 import region_amax

    wire = plan.wire
    man = plan.src.manifest.tensors
    out: dict[tuple, float] = {}
    for t, sh in src_shards.items():
        if t not in wire.cut:
            continue
        shape = man[t].shape
        for a, replicas in plan.unique_boxes(shape, plan.src.placements[t]):
            if replicas[0] != rank:
                continue
            for rim in split_whole(a, shape, wire.block)[1]:  # the blocks `a` cuts, as far as it holds them
                amax = region_amax(sh.read(rim), rim.offsets, wire.block)
                first = scale_offset(rim.offsets, wire.block)
                for idx, v in zip(itertools.product(*map(range, amax.shape)), amax.reshape(-1).tolist()):
                    key = (t, tuple(f + i for f, i in zip(first, idx)))
                    out[key] = _max(out.get(key), v)
    return out


def merge_amax(parts) -> dict:
    """Every block's max |x| from every rank's `cut_block_amax`."""
    out: dict[tuple, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = _max(out.get(k), v)
    return out


def _max(a: float | None, b: float) -> float:
    """The larger, NaN if either is (as torch's max over a block)."""
    return b if a is None or b != b or (a == a and b > a) else a


def source_contributions(plan, rank: int, src_shards: dict, amax: dict | None = None) -> dict:
    """What this source rank contributes to each destination box's expected checksum.

    The first replica of each unique source box speaks for it; the key is (tensor, destination box offsets).
    `amax`: into a block-FP8 engine whose blocks source shards cut, every such block's max |x|
    (`merge_amax`)."""
    man = plan.src.manifest.tensors
    out: dict[tuple, int] = {}
    for t, sh in src_shards.items():
        shape = man[t].shape
        for a, replicas in plan.unique_boxes(shape, plan.src.placements[t]):
            if replicas[0] != rank:
                continue
            for b, _holders in plan.unique_boxes(shape, plan.dst.placements[t]):
                r = a.intersect(b)
                if r is not None:
                    key = (t, b.offsets)
                    out[key] = combine([out.get(key, 0), _source_checksum(plan.wire, t, sh, r, shape, amax)])
    return out


def _source_checksum(wire, t: int, sh, r, shape: tuple, amax: dict | None) -> int:
    """Of region `r` as the destination holds it: the source's bytes, or for an FP8 engine's weight the FP8
    bytes and scales the sender makes of its whole blocks, and of the rest the source's bytes as they land and
    the FP8 bytes and scales the destination makes of them (`_stored_checksum`)."""
    if t not in wire.quantized:
        return checksum(sh.read(r), r, shape)
    from reshard_cli.base.fp8 import quantize_region

    out = []
    for part in wire.parts(t, r):
        x = sh.read(part)
        if wire.fp8(t, part):
            out.append(_fp8_checksum(wire, *quantize_region(x, part.offsets, shape, wire.block), part, shape))
        else:
            out += [checksum(x, part, shape), _stored_checksum(wire, t, x, part, shape, amax)]
    return combine(out)


def _stored_checksum(wire, t: int, x, part: Box, shape: tuple, amax: dict | None) -> int:
    """Of `part` (its data `x`) of blocks a source shard boundary cuts, as the engine stores it once the
    destination quantized those blocks whole: its FP8 bytes, from each block's max |x| over all its parts
    (`amax`), and the scales of the blocks whose first element it holds (one part speaks for each block)."""
    import torch

    from reshard_cli.base.fp8 import block_scales, quantize_part

    if amax is None:
        raise ValueError(f"tensor {t}: blocks cut by source shards need their max |x| (cut_block_amax)")
    (bm, bn), lead = wire.block, part.sizes[:-2]
    first = scale_offset(part.offsets, wire.block)
    hull = (*lead, -(-(part.offsets[-2] % bm + part.sizes[-2]) // bm), -(-(part.offsets[-1] % bn + part.sizes[-1]) // bn))
    cells = itertools.product(*(range(f, f + n) for f, n in zip(first, hull)))
    block_amax = torch.tensor([amax[(t, c)] for c in cells], dtype=torch.float32, device=x.device).reshape(hull)
    q = quantize_part(x, part.offsets, block_amax, wire.block)
    rows = torch.arange(first[-2], first[-2] + hull[-2], device=x.device) * bm >= part.offsets[-2]
    cols = torch.arange(first[-1], first[-1] + hull[-1], device=x.device) * bn >= part.offsets[-1]
    scales = torch.where(rows[:, None] & cols[None, :], block_scales(block_amax), 0.0)  # +0.0 adds nothing
    return combine([checksum(_canonical(q), part, shape),
                    checksum(_canonical(scales), Box(first, hull), blocks_of(shape, wire.block))])


def _fp8_checksum(wire, q, scale, part, shape: tuple) -> int:
    sbox = Box(scale_offset(part.offsets, wire.block), blocks_of(part.sizes, wire.block))
    return combine([checksum(_canonical(q), part, shape), checksum(_canonical(scale), sbox, blocks_of(shape, wire.block))])


def _canonical(x):
    """FP8 bytes or float32 scales with every NaN as one bit pattern: a block holding a NaN is NaN (vLLM's, and
    `base.fp8`'s), but the sign its NaNs get depends on the order of its reductions."""
    import torch

    if x.dtype == torch.float32:
        return torch.where(torch.isnan(x), torch.tensor(float("nan"), device=x.device), x)
    bits = x.view(torch.uint8)
    return torch.where(bits & 0x7F == 0x7F, torch.tensor(0x7F, dtype=torch.uint8, device=x.device), bits)


def destination_checksum(plan, t: int, sh) -> int:
    """A destination shard's checksum, comparable with the sources' (`source_contributions`): of what it
    holds, or for a block-FP8 engine's weight of its FP8 storage and scales (every block, however it was
    quantized) and of the parts that arrived in the source's dtype, as they landed."""
    shape = plan.src.manifest.tensors[t].shape
    wire = plan.wire
    if sh.fp8 is None or t not in wire.quantized:
        return checksum(sh.data, sh.box, shape)
    sbox = Box(scale_offset(sh.box.offsets, wire.block), blocks_of(sh.box.sizes, wire.block))
    out = [checksum(_canonical(sh.fp8), sh.box, shape),
           checksum(_canonical(sh.scale), sbox, blocks_of(shape, wire.block))]
    for a, _replicas in plan.unique_boxes(shape, plan.src.placements[t]):
        r = a.intersect(sh.box)
        for part in wire.parts(t, r) if r is not None else ():
            if not wire.fp8(t, part):
                out.append(checksum(sh.read(part), part, shape))
    return combine(out)


def merge_contributions(parts) -> dict:
    """Expected checksum per (tensor, destination box offsets), from every source rank's contributions."""
    out: dict[tuple, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = combine([out.get(k, 0), v])
    return out


def mismatched_checksums(plan, rank: int, src_shards: dict, dst_shards: dict, extra=None,
                         comm=None) -> tuple[dict[int, int], list[int], list]:
    """Collective (every rank of `comm`, the default group when None): each destination shard's checksum against
    the sources' checksum of the same box. Returns (this rank's checksum per tensor, the tensors whose checksum
    differs, and what every rank passed as `extra`). Into a block-FP8 engine whose blocks source shards cut, the
    ranks first agree on those blocks' max |x| (one more collective, on every rank alike)."""
    from reshard_cli.transfer.comm import WORLD

    comm = comm or WORLD
    amax = None
    if plan.wire.cut:
        amax = merge_amax(comm.all_gather_object(cut_block_amax(plan, rank, src_shards), what="cut blocks' amax"))
    actual = {t: destination_checksum(plan, t, sh) for t, sh in dst_shards.items()}
    gathered = comm.all_gather_object((source_contributions(plan, rank, src_shards, amax), extra))
    expected = merge_contributions(c for c, _x in gathered)
    bad = [t for t, sh in dst_shards.items() if sh.box.numel and expected.get((t, sh.box.offsets), 0) != actual[t]]
    return actual, bad, [x for _c, x in gathered]
