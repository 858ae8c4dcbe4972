"""Checksums against the plan: what each source rank contributes to every destination box, and the
collective comparison of what landed with what was sent (the formula: `base.checksums`)."""
from __future__ import annotations

from reshard_cli.base.blocks import blocks_of, scale_offset
from reshard_cli.base.checksums import checksum, combine
from reshard_cli.base.geometry import Box


def source_contributions(plan, rank: int, src_shards: dict) -> dict:
    """What this source rank contributes to each destination box's expected checksum.

    The first replica of each unique source box speaks for it; the key is (tensor, destination box offsets).
    """
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
                    out[key] = combine([out.get(key, 0), _source_checksum(plan.wire, t, sh, r, shape)])
    return out


def _source_checksum(wire, t: int, sh, r, shape: tuple) -> int:
    """Of region `r` as it travels: the source's bytes, or (whole blocks of an FP8 engine's weight) the FP8
    bytes and scales the sender makes of them."""
    if t not in wire.quantized:
        return checksum(sh.read(r), r, shape)
    from reshard_cli.base.fp8 import quantize_region

    out = []
    for part in wire.parts(t, r):
        if wire.fp8(t, part):
            out.append(_fp8_checksum(wire, *quantize_region(sh.read(part), part.offsets, shape, wire.block), part,
                                     shape))
        else:
            out.append(checksum(sh.read(part), part, shape))
    return combine(out)


def _fp8_checksum(wire, q, scale, part, shape: tuple) -> int:
    sbox = Box(scale_offset(part.offsets, wire.block), blocks_of(part.sizes, wire.block))
    return combine([checksum(q, part, shape), checksum(scale, sbox, blocks_of(shape, wire.block))])


def destination_checksum(plan, t: int, sh) -> int:
    """A destination shard's checksum, comparable with the sources' (`source_contributions`): of what it
    holds, or for a block-FP8 engine's weight, region by region as it arrived (FP8 bytes and scales of the
    whole blocks, the source's bytes of the rest)."""
    shape = plan.src.manifest.tensors[t].shape
    wire = plan.wire
    if sh.fp8 is None or t not in wire.quantized:
        return checksum(sh.data, sh.box, shape)
    out = []
    for a, _replicas in plan.unique_boxes(shape, plan.src.placements[t]):
        r = a.intersect(sh.box)
        for part in wire.parts(t, r) if r is not None else ():
            if wire.fp8(t, part):
                out.append(_fp8_checksum(wire, *sh.read_fp8(part, wire.block), part, shape))
            else:
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
    differs, and what every rank passed as `extra`)."""
    from reshard_cli.transfer.comm import WORLD

    actual = {t: destination_checksum(plan, t, sh) for t, sh in dst_shards.items()}
    gathered = (comm or WORLD).all_gather_object((source_contributions(plan, rank, src_shards), extra))
    expected = merge_contributions(c for c, _x in gathered)
    bad = [t for t, sh in dst_shards.items() if sh.box.numel and expected.get((t, sh.box.offsets), 0) != actual[t]]
    return actual, bad, [x for _c, x in gathered]
