"""Checksums against the plan: what each source rank contributes to every destination box, and the
collective comparison of what landed with what was sent (the formula: `base.checksums`).

What a destination's checksum covers is its plan's codec's (`codecs`): the source's bytes as they land, or
what a quantized engine stores of them. The sources compute the same from their shards, after agreeing on the
values the codec needs from every one of them (`Codec.agreement`: the max |x| of blocks source shards cut). So
a wrong conversion on the destination, or a byte of its storage changed afterwards, is named like a byte that
never arrived.
"""
from __future__ import annotations

from reshard_cli.base.checksums import combine
from reshard_cli.codecs import codec_for


def source_contributions(plan, rank: int, src_shards: dict, agreed: dict | None = None, codec=None) -> dict:
    """What this source rank contributes to each destination box's expected checksum.

    The first replica of each unique source box speaks for it; the key is (tensor, destination box offsets).
    `agreed`: what the codec's agreement gave (`Codec.merge` of every rank's `Codec.agreement`)."""
    codec = codec or codec_for(plan)
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
                    out[key] = combine([out.get(key, 0), codec.source_checksum(t, sh, r, shape, agreed)])
    return out


def destination_checksum(plan, t: int, sh, codec=None) -> int:
    """A destination shard's checksum, comparable with the sources' (`source_contributions`): of what it
    stores (`Codec.stored_checksum`)."""
    return (codec or codec_for(plan)).stored_checksum(t, sh, plan.src.manifest.tensors[t].shape)


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
    differs, and what every rank passed as `extra`). Where the plan's codec needs values agreed over every
    source first (`Codec.agreement`), one more collective comes first, on every rank alike."""
    from reshard_cli.transfer.comm import WORLD

    comm = comm or WORLD
    codec = codec_for(plan)
    mine = codec.agreement(rank, src_shards)
    agreed = None
    if mine is not None:
        agreed = codec.merge(comm.all_gather_object(mine, what=f"the {codec.name} codec's agreement"))
    actual = {t: destination_checksum(plan, t, sh, codec) for t, sh in dst_shards.items()}
    gathered = comm.all_gather_object((source_contributions(plan, rank, src_shards, agreed, codec), extra))
    expected = merge_contributions(c for c, _x in gathered)
    bad = [t for t, sh in dst_shards.items() if sh.box.numel and expected.get((t, sh.box.offsets), 0) != actual[t]]
    return actual, bad, [x for _c, x in gathered]
