"""The FP8 block grid, without torch: which regions hold whole blocks, where their scales go, and how a region
splits into the part whose blocks lie wholly inside it and the rim around it. The plan uses it to decide which
bytes a sender can quantize (`plan.fp8`); `base.fp8` quantizes on it."""
from __future__ import annotations

from typing import Sequence

from reshard_cli.base.geometry import Box, chunk_range

BLOCK = (128, 128)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_block(block: Sequence[int]) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) != b or b <= 0 for b in block):
        raise ValueError(f"block must be two positive ints, got {tuple(block)}")
    return int(block[0]), int(block[1])


def blocks_of(shape: Sequence[int], block: Sequence[int] = BLOCK) -> tuple[int, ...]:
    """The scale tensor's shape for a tensor of `shape`: leading dims kept, the last two in blocks (rounded
    up)."""
    bm, bn = _check_block(block)
    if len(shape) < 2:
        raise ValueError(f"block quantization needs at least 2 dims, got shape {tuple(shape)}")
    *lead, m, n = shape
    return (*lead, _cdiv(m, bm), _cdiv(n, bn))


def scale_offset(offset: Sequence[int], block: Sequence[int] = BLOCK) -> tuple[int, ...]:
    """Where a whole-block region at `offset` puts its scales in the full tensor's scale tensor."""
    bm, bn = _check_block(block)
    *lead, om, on = offset
    return (*lead, om // bm, on // bn)


def _misaligned(offset: Sequence[int], size: Sequence[int], full_shape: Sequence[int],
                block: Sequence[int]) -> str | None:
    """Why the region is not whole blocks, or None when it is."""
    if not (len(offset) == len(size) == len(full_shape)) or len(full_shape) < 2:
        raise ValueError(f"offset {tuple(offset)}, size {tuple(size)} and full shape {tuple(full_shape)} "
                         "must have the same number (at least 2) of dims")
    for d, (o, s, n) in enumerate(zip(offset, size, full_shape)):
        if o < 0 or s < 0 or o + s > n:
            raise ValueError(f"dim {d}: region [{o}, {o + s}) is outside the full extent {n}")
    if any(s == 0 for s in size):
        return None  # nothing to quantize
    nd = len(full_shape)
    for d, b in zip((nd - 2, nd - 1), _check_block(block)):
        o, s, n = offset[d], size[d], full_shape[d]
        if o % b:
            return f"dim {d}: offset {o} is not a multiple of the block ({b})"
        if (o + s) % b and o + s != n:
            return f"dim {d}: end {o + s} is neither a multiple of the block ({b}) nor the full extent {n}"
    return None


def whole_blocks(offset: Sequence[int], size: Sequence[int], full_shape: Sequence[int],
                 block: Sequence[int] = BLOCK) -> bool:
    """True when the region (`offset`, `size`) of a tensor of `full_shape` holds whole blocks only, so it
    quantizes on its own to exactly the full tensor's q and scales there. An empty region is whole."""
    return _misaligned(offset, size, full_shape, block) is None


def _grid(o: int, n: int, b: int, full: int) -> tuple[int, int]:
    """The part of [o, o + n) on the block grid: start rounded up, end rounded down (the full extent counts
    as a grid line)."""
    lo = -(-o // b) * b
    hi = o + n if o + n == full else (o + n) // b * b
    return lo, max(lo, hi)


def split_whole(box: Box, full_shape: Sequence[int], block: Sequence[int] = BLOCK) -> tuple[Box | None, list[Box]]:
    """(inner, rim): `inner` is the largest part of `box` that holds whole blocks (None when no block lies
    wholly inside it), `rim` the rest as disjoint boxes (none when the box is whole blocks). Every block the
    box cuts lies in the rim entirely, as far as the box has it; no rim box holds whole blocks."""
    if len(full_shape) < 2 or box.empty:
        return None, [box] if not box.empty else []
    nd = len(full_shape)
    bm, bn = _check_block(block)
    ranges = [_grid(box.offsets[d], box.sizes[d], b, full_shape[d]) for d, b in ((nd - 2, bm), (nd - 1, bn))]
    if any(lo >= hi for lo, hi in ranges):
        return None, [box]
    offs, sizes = list(box.offsets), list(box.sizes)
    rim = []
    for d, (lo, hi) in zip((nd - 2, nd - 1), ranges):  # slabs before and after the inner range, dim by dim
        o, n = offs[d], sizes[d]
        for a, z in ((o, lo), (hi, o + n)):
            if z > a:
                rim.append(Box(tuple(offs[:d] + [a] + offs[d + 1:]), tuple(sizes[:d] + [z - a] + sizes[d + 1:])))
        offs[d], sizes[d] = lo, hi - lo
    return Box(tuple(offs), tuple(sizes)), rim


def grid_split(box: Box, parts: int, full_shape: Sequence[int], block: Sequence[int] = BLOCK) -> list[Box]:
    """`box.split(parts)` with cuts on the block grid: a leading dim (experts) is cut anywhere, the last two
    only on block boundaries, so that a box of whole blocks splits into boxes of whole blocks (a box with
    fewer blocks than `parts` along the chosen dim gives some empty boxes)."""
    if parts <= 1 or len(full_shape) < 2:
        return box.split(parts)
    nd = len(full_shape)
    step = dict(zip((nd - 2, nd - 1), _check_block(block)))
    units = []  # per dim: the cut points of its blocks inside the box
    for d, (o, n) in enumerate(zip(box.offsets, box.sizes)):
        b = step.get(d, 1)
        cuts = sorted({o, o + n, *range(-(-o // b) * b, o + n, b)})
        units.append(cuts)
    dim = next((d for d, c in enumerate(units) if len(c) - 1 >= parts),
               max(range(len(units)), key=lambda d: len(units[d])))
    cuts = units[dim]
    out = []
    for i in range(parts):
        start, size = chunk_range(len(cuts) - 1, parts, i)
        lo = cuts[start] if size else box.offsets[dim]
        hi = cuts[start + size] if size else lo
        offs, sizes = list(box.offsets), list(box.sizes)
        offs[dim], sizes[dim] = lo, hi - lo
        out.append(Box(tuple(offs), tuple(sizes)))
    return out
