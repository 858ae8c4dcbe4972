"""Checksums against the plan: what each source rank contributes to every destination box, and the
collective comparison of what landed with what was sent (the formula: `base.checksums`)."""
from __future__ import annotations

from reshard_cli.base.checksums import checksum, combine


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
                    out[key] = combine([out.get(key, 0), checksum(sh.read(r), r, shape)])
    return out


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

    man = plan.src.manifest.tensors
    actual = {t: checksum(sh.data, sh.box, man[t].shape) for t, sh in dst_shards.items()}
    gathered = (comm or WORLD).all_gather_object((source_contributions(plan, rank, src_shards), extra))
    expected = merge_contributions(c for c, _x in gathered)
    bad = [t for t, sh in dst_shards.items() if sh.box.numel and expected.get((t, sh.box.offsets), 0) != actual[t]]
    return actual, bad, [x for _c, x in gathered]
