"""Position-aware checksums: prove that every element sits at the right global index with the right bits.

    checksum(region) = Σ_i  w(i) · bits(x_i)   (mod 2^64)

where i is the element's *global* flat index in the full tensor, w(i) a 31-bit mix of i, and bits(x) the
value's raw bit pattern. The sum is additive over disjoint regions, so sources can compute it for the parts
they hold and destinations for what they received, and the two must agree without any full tensor existing
anywhere. A misplaced element changes w, a missing one (a sentinel left in place) or a corrupted one changes
bits, a duplicated one changes both; a fault escapes only with probability about 2^-31.
"""
from __future__ import annotations

import torch

from reshard_cli.geometry import Box

_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 20  # elements per step: bounds the int64 temporaries


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Raw bit pattern of every element as int64 (unsigned for narrow types)."""
    size = x.element_size()
    if size == 1:
        return x.view(torch.uint8).to(torch.int64)
    if size == 2:
        return x.view(torch.int16).to(torch.int64) & 0xFFFF
    if size == 4:
        return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if size == 8:
        v = x.view(torch.int64)
        return (v ^ (v >> 32)) & 0xFFFFFFFF  # fold 64 bits into 32 so the product stays in range
    raise ValueError(f"unsupported dtype {x.dtype}")


def _weights(idx: torch.Tensor) -> torch.Tensor:
    """A 31-bit mix of the global index (xorshift-multiply)."""
    h = (idx + 0x5BD1E995) * 0x27D4EB2D
    h = h ^ (h >> 15)
    h = (h & 0x7FFFFFFF) * 0x165667B1
    h = h ^ (h >> 13)
    return (h & 0x7FFFFFFF) | 1


def global_index(box: Box, shape: tuple, rows: slice | None = None) -> torch.Tensor:
    """Global flat indices of the elements of `box` (optionally rows [a, b) of its first dim), row-major."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    idx = torch.zeros((), dtype=torch.int64)
    for d, (o, s) in enumerate(zip(box.offsets, box.sizes)):
        lo, hi = (o, o + s)
        if d == 0 and rows is not None:
            lo, hi = o + rows.start, o + rows.stop
        ax = torch.arange(lo, hi, dtype=torch.int64) * strides[d]
        idx = idx.unsqueeze(-1) + ax if d else ax
    return idx


def checksum(x: torch.Tensor, box: Box, shape: tuple) -> int:
    """Checksum of `x`, which holds global region `box` of a tensor of `shape` (mod 2^64, as a Python int)."""
    if x.numel() == 0:
        return 0
    if tuple(x.shape) != tuple(box.sizes):
        raise ValueError(f"tensor shape {tuple(x.shape)} != box {box.sizes}")
    x = x.detach().cpu() if x.device.type != "cpu" else x.detach()
    if not shape:  # a scalar
        return int((_weights(torch.zeros((), dtype=torch.int64)) * _bits(x.reshape(1))).sum()) & _MASK64
    total = 0
    row_elems = max(x[0].numel() if x.dim() else 1, 1)
    step = max(1, _CHUNK // row_elems)
    for a in range(0, box.sizes[0], step):
        b = min(a + step, box.sizes[0])
        part = x[a:b].contiguous()
        w = _weights(global_index(box, shape, slice(a, b))).reshape(-1)
        total += int((w * _bits(part.reshape(-1))).sum())  # int64 sum wraps mod 2^64; fine for a checksum
    return total & _MASK64


def combine(values) -> int:
    """Checksums of disjoint regions add up to the checksum of their union."""
    return sum(values) & _MASK64


def fmt(c: int) -> str:
    return f"{c:016x}"


def source_contributions(plan, rank: int, src_shards: dict) -> dict:
    """What this source rank contributes to each destination box's expected checksum.

    The first replica of each unique source box speaks for it; the key is (tensor, destination box offsets).
    """
    man = plan.src.manifest.tensors
    out: dict[tuple, int] = {}
    for t, sh in src_shards.items():
        shape = man[t].shape
        for a, replicas in plan._unique_boxes(shape, plan.src.placements[t]):
            if replicas[0] != rank:
                continue
            for b, _holders in plan._unique_boxes(shape, plan.dst.placements[t]):
                r = a.intersect(b)
                if r is not None:
                    key = (t, b.offsets)
                    out[key] = combine([out.get(key, 0), checksum(sh.data[r.local_slices(sh.box)], r, shape)])
    return out


def merge_contributions(parts) -> dict:
    """Expected checksum per (tensor, destination box offsets), from every source rank's contributions."""
    out: dict[tuple, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = combine([out.get(k, 0), v])
    return out
