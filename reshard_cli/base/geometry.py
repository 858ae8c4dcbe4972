"""Box geometry with DTensor's exact shard semantics. Small and pure; the one geometry used everywhere.

A placement per mesh dim is either `None` (Replicate) or an int `d` (Shard(d)). `Shard(d)` follows
`torch.chunk`: with n elements over k parts the chunk is c = ceil(n/k) and part i is
[min(i*c, n), min((i+1)*c, n)) — trailing parts may be empty. Several mesh dims sharding the same tensor dim
nest left to right: each step chunks the extent left by the previous one (what DTensor does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Placements = tuple  # tuple[int | None, ...], one entry per mesh dim


def chunk_range(n: int, parts: int, i: int, pad: int = 1) -> tuple[int, int]:
    """(start, size) of part `i` of `n` split `parts` ways, torch.chunk style.

    `pad` > 1 chunks the extent rounded up to a multiple of `pad` and clips the parts to `n`: an inference
    engine's padded vocabulary (vLLM pads it to a multiple of 64, then gives each TP rank an equal part),
    whose padding rows exist only in the engine's storage, not in the checkpoint."""
    c = chunk_size(n, parts, pad)
    start = min(i * c, n)
    return start, min(start + c, n) - start


def chunk_size(n: int, parts: int, pad: int = 1) -> int:
    """The extent of one part before clipping to `n` (see `chunk_range`): what an engine allocates per part."""
    m = -(-n // pad) * pad if pad > 1 else n
    return -(-m // parts) if parts else m


@dataclass(frozen=True, slots=True, order=True)
class Box:
    """A dense n-d region: `offsets` and `sizes` per tensor dim (global coordinates)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def full(shape: Sequence[int]) -> "Box":
        return Box((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: "Box") -> "Box | None":
        """The common region, or None when it is empty."""
        offs, sizes = [], []
        for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + sa, b + sb)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def relative_to(self, outer: "Box") -> tuple[int, ...]:
        """Offsets of this box inside `outer` (which must contain it)."""
        return tuple(a - b for a, b in zip(self.offsets, outer.offsets))

    def split(self, parts: int) -> list["Box"]:
        """Split into `parts` boxes along one dim (torch.chunk style; some may be empty; a scalar stays whole).

        The first dim with at least `parts` elements is used, so pieces stay as contiguous as possible;
        failing that, the largest dim.
        """
        if parts <= 1 or not self.sizes:  # a scalar cannot be split: one part
            return [self]
        dim = next((d for d, s in enumerate(self.sizes) if s >= parts),
                   max(range(len(self.sizes)), key=lambda d: self.sizes[d]))
        out = []
        for i in range(parts):
            start, size = chunk_range(self.sizes[dim], parts, i)
            offs = list(self.offsets)
            sizes = list(self.sizes)
            offs[dim] += start
            sizes[dim] = size
            out.append(Box(tuple(offs), tuple(sizes)))
        return out

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def local_slices(self, outer: "Box") -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.relative_to(outer), self.sizes))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def shard_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Placements,
              pad: int = 1) -> Box:
    """The global box that mesh coordinate `coord` holds (DTensor-exact, nested and uneven shards; `pad` as in
    `chunk_range`, 1 for DTensor)."""
    offsets = [0] * len(shape)
    sizes = list(shape)
    for m, p in enumerate(placements):
        if p is None:
            continue
        start, size = chunk_range(sizes[p], mesh_shape[m], coord[m], pad)
        offsets[p] += start
        sizes[p] = size
        if size == 0:  # DTensor puts an empty shard at the end of the dim
            offsets[p] = shape[p]
    return Box(tuple(offsets), tuple(sizes))


def is_contiguous_region(box: Box, outer_shape: Sequence[int]) -> bool:
    """True when `box` (relative to a tensor of `outer_shape`) is one contiguous run in row-major memory."""
    # After the first dim (from the left) that is not size 1, every later dim must be full.
    seen_partial = False
    for s, n in zip(box.sizes, outer_shape):
        if seen_partial and s != n:
            return box.numel == 0
        if s != 1:
            seen_partial = True
    return True
