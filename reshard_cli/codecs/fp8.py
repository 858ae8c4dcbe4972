"""The block-FP8 codec: into an engine that stores a weight as float8_e4m3fn with a float32 scale per block.

An item of whole blocks travels quantized by its sender (`plan.fp8.Wire`: its FP8 bytes, then at `scale_at`
its blocks' scales) and lands in the engine's storage as it is; every other item of a quantized tensor (the rim
a source shard boundary cuts, every block of a broadcast tensor) travels in the source's dtype into a buffer
beside the storage, and the destination quantizes the blocks it completes once everything landed (`finish`).

Checksums cover what the engine stores: its FP8 bytes and scales, and the source's bytes of the parts that
arrived unquantized. The sources compute the same: the blocks their shard holds whole they quantize as they
send them; for a block several shards share, the ranks first agree on its max |x| (`agreement`, each over its
part; `merge`), from which each quantizes its own part to the bytes the destination must hold, and one part
(the one holding the block's first element) speaks for its scale. So a wrong quantization on the destination,
or a byte of its storage changed afterwards, is named like a byte that never arrived.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from reshard_cli.base.blocks import blocks_of, scale_offset, split_whole
from reshard_cli.base.checksums import checksum, combine
from reshard_cli.base.fp8 import FP8, block_scales, quantize_part, quantize_region, region_amax
from reshard_cli.base.geometry import Box
from reshard_cli.codecs import Codec
from reshard_cli.errors import ConfigError


@dataclass(frozen=True)
class FP8Landing:
    """A destination buffer for one box of a block-FP8 engine's weight, as an engine's `Stage.open` hands it
    out: the engine's FP8 storage of the box and of its scales, written in place (the whole blocks a sender
    quantized land there, and the blocks completed here are quantized into them once the transfer is done).
    Items that arrive unquantized (blocks a source shard cuts, broadcast tensors) need a buffer in the
    source's dtype: `data`, or when None one the refit allocates only if the plan sends this box such items,
    and appends to `held` (the engine's to count and drop)."""

    fp8: torch.Tensor  # float8_e4m3fn, the box's shape
    scale: torch.Tensor  # float32, `blocks_of(box)`
    data: torch.Tensor | None = None  # the box, in the checkpoint's dtype
    held: list = field(default_factory=list, compare=False)

    def buffers(self) -> tuple:
        return (self.fp8, self.scale) + ((self.data,) if self.data is not None else ())


class BlockFP8(Codec):
    name = "fp8-block"
    converts = True

    def __init__(self, plan):
        super().__init__(plan)
        self.block = self.wire.block

    # ---------------------------------------------------------------------------------------- the wire

    def encoded(self, t: int, box: Box) -> bool:
        return self.wire.fp8(t, box)

    def _slot(self, buf: torch.Tensor, box: Box, off: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantized item's place in a message: its FP8 bytes, then its scales."""
        at, sshape = off + self.wire.scale_at(box), blocks_of(box.sizes, self.block)
        n = 1
        for x in sshape:
            n *= x
        return (buf[off:off + box.numel].view(FP8).view(box.sizes),
                buf[at:at + 4 * n].view(torch.float32).view(sshape))

    def _stored(self, t: int, box: Box, shard) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's FP8 storage of `box` (whole blocks) and of its scales, in `shard`."""
        landing = shard.stored if shard is not None else None
        if landing is None:
            raise RuntimeError(f"{self.plan.src.manifest.tensors[t].name} arrives quantized but its destination "
                               f"shard has no FP8 storage")
        rel = box.relative_to(shard.box)
        blocks = tuple(slice(o // b, -(-(o + n) // b)) for o, n, b in zip(rel[-2:], box.sizes[-2:], self.block))
        lead = tuple(slice(o, o + n) for o, n in zip(rel[:-2], box.sizes[:-2]))
        return landing.fp8[box.local_slices(shard.box)], landing.scale[lead + blocks]

    def encode(self, buf, off, t, box, x) -> None:
        quantize_region(x, box.offsets, self.plan.src.manifest.tensors[t].shape, self.block,
                        out=self._slot(buf, box, off))

    def forward(self, buf, off, t, box, shard) -> None:
        q, s = self._slot(buf, box, off)
        dq, ds = self._stored(t, box, shard)
        q.copy_(dq)
        s.copy_(ds)

    def land(self, buf, off, t, box, shard) -> None:
        q, s = self._slot(buf, box, off)
        dq, ds = self._stored(t, box, shard)
        dq.copy_(q)
        ds.copy_(s)

    def finish(self, received, whole, shards: dict) -> int:
        """Quantize the blocks that arrived unquantized (those a source shard boundary cuts, and every block of
        a broadcast tensor) from the source dtype into the engine's FP8 storage."""
        regions: dict[int, set] = {}  # tensor -> block-grid boxes to quantize here
        for t, box in received:
            if t in self.wire.quantized and not self.wire.fp8(t, box):
                regions.setdefault(t, set()).add(self._hull(t, box))
        for t in whole:
            sh = shards.get(t)
            if t in self.wire.quantized and sh is not None and sh.box.numel:
                regions.setdefault(t, set()).add(sh.box)
        done = 0
        for t, boxes in regions.items():  # hulls of two rims may share a corner block: quantized alike twice
            shape, sh = self.plan.src.manifest.tensors[t].shape, shards[t]
            for box in sorted(boxes):
                q, scale = quantize_region(sh.data[box.local_slices(sh.box)], box.offsets, shape, self.block)
                dq, ds = self._stored(t, box, sh)
                dq.copy_(q)
                ds.copy_(scale)
                done += box.numel
        return done

    def _hull(self, t: int, box: Box) -> Box:
        """The blocks `box` touches (every one of them arrived unquantized: see `plan.fp8.Wire`)."""
        shape = self.plan.src.manifest.tensors[t].shape
        offs, sizes = list(box.offsets), list(box.sizes)
        for d, b in zip((len(shape) - 2, len(shape) - 1), self.block):
            lo, hi = offs[d] // b * b, min(-(-(offs[d] + sizes[d]) // b) * b, shape[d])
            offs[d], sizes[d] = lo, hi - lo
        return Box(tuple(offs), tuple(sizes))

    # ------------------------------------------------------------------------------------- the storage

    def stores(self, t: int) -> bool:
        return t in self.wire.quantized

    def shard(self, rank: int, t: int, box: Box, given) -> tuple:
        """A block-FP8 engine's weight: an `FP8Landing` (its storage, and a buffer for what arrives unquantized,
        allocated here when the landing has none and the plan sends the box such items). Returns (that buffer,
        the landing)."""
        spec = self.plan.src.manifest.tensors[t]
        if not isinstance(given, FP8Landing):
            raise ConfigError(f"rank {rank}: {spec.name} is block-FP8 in the destination layout "
                              f"(engine.quantization): pass its engine storage as an FP8Landing, as an engine's "
                              f"Stage.open does", key=spec.name)
        data = given.data
        if data is None:
            need = self.wire.unquantized_into(self.plan, t, box)
            data = torch.empty(box.sizes if need else (0,) * len(box.sizes), dtype=getattr(torch, spec.dtype),
                               device=given.fp8.device)
            given.held.append(data)
        want = ((box.sizes, "float8_e4m3fn"), (blocks_of(box.sizes, self.block), "float32"))
        for what, x, (shape, dtype) in zip(("FP8 storage", "scales"), (given.fp8, given.scale), want):
            if tuple(x.shape) != tuple(shape) or str(x.dtype).removeprefix("torch.") != dtype:
                raise ConfigError(f"rank {rank}: {spec.name}: the {what} is {list(x.shape)} {x.dtype}, the "
                                  f"destination layout expects {list(shape)} {dtype}", key=spec.name)
        if data.numel() and (tuple(data.shape) != box.sizes or not data.is_contiguous()
                             or str(data.dtype).removeprefix("torch.") != spec.dtype):
            raise ConfigError(f"rank {rank}: {spec.name}: the buffer is {list(data.shape)} {data.dtype}, the "
                              f"destination layout expects {list(box.sizes)} {spec.dtype}, contiguous", key=spec.name)
        return data, given

    # ------------------------------------------------------------------------------------ the checksums

    def agreement(self, rank: int, src_shards: dict):
        """This source rank's part of each block a source shard boundary cuts: (tensor, block index) -> max |x|
        over the part it holds (the first replica of each unique source box speaks for it); None when no
        block is cut."""
        wire, plan = self.wire, self.plan
        if not wire.cut:
            return None
        man = plan.src.manifest.tensors
        out: dict[tuple, float] = {}
        for t, sh in src_shards.items():
            if t not in wire.cut:
                continue
            shape = man[t].shape
            for a, replicas in plan.unique_boxes(shape, plan.src.placements[t]):
                if replicas[0] != rank:
                    continue
                for rim in split_whole(a, shape, self.block)[1]:  # the blocks `a` cuts, as far as it holds them
                    amax = region_amax(sh.read(rim), rim.offsets, self.block)
                    first = scale_offset(rim.offsets, self.block)
                    for idx, v in zip(itertools.product(*map(range, amax.shape)), amax.reshape(-1).tolist()):
                        key = (t, tuple(f + i for f, i in zip(first, idx)))
                        out[key] = _max(out.get(key), v)
        return out

    def merge(self, parts) -> dict:
        """Every cut block's max |x| from every rank's `agreement`."""
        out: dict[tuple, float] = {}
        for part in parts:
            for k, v in (part or {}).items():
                out[k] = _max(out.get(k), v)
        return out

    def source_checksum(self, t: int, shard, r, shape: tuple, agreed) -> int:
        """Of region `r` as the destination holds it: for a quantized tensor the FP8 bytes and scales the sender
        makes of its whole blocks, and of the rest the source's bytes as they land and the FP8 bytes and scales
        the destination makes of them (`_stored_part`)."""
        if t not in self.wire.quantized:
            return super().source_checksum(t, shard, r, shape, agreed)
        out = []
        for part in self.wire.parts(t, r):
            data = shard.read(part)
            if self.wire.fp8(t, part):
                out.append(self._checksum(*quantize_region(data, part.offsets, shape, self.block), part, shape))
            else:
                out += [checksum(data, part, shape), self._stored_part(t, data, part, shape, agreed)]
        return combine(out)

    def _stored_part(self, t: int, x, part: Box, shape: tuple, amax: dict | None) -> int:
        """Of `part` (its data `x`) of blocks a source shard boundary cuts, as the engine stores it once the
        destination quantized those blocks whole: its FP8 bytes, from each block's max |x| over all its parts
        (`amax`), and the scales of the blocks whose first element it holds (one part speaks for each)."""
        if amax is None:
            raise ValueError(f"tensor {t}: blocks cut by source shards need their max |x| (agreement)")
        (bm, bn), lead = self.block, part.sizes[:-2]
        first = scale_offset(part.offsets, self.block)
        hull = (*lead, -(-(part.offsets[-2] % bm + part.sizes[-2]) // bm),
                -(-(part.offsets[-1] % bn + part.sizes[-1]) // bn))
        cells = itertools.product(*(range(f, f + n) for f, n in zip(first, hull)))
        block_amax = torch.tensor([amax[(t, c)] for c in cells], dtype=torch.float32, device=x.device).reshape(hull)
        q = quantize_part(x, part.offsets, block_amax, self.block)
        rows = torch.arange(first[-2], first[-2] + hull[-2], device=x.device) * bm >= part.offsets[-2]
        cols = torch.arange(first[-1], first[-1] + hull[-1], device=x.device) * bn >= part.offsets[-1]
        scales = torch.where(rows[:, None] & cols[None, :], block_scales(block_amax), 0.0)  # +0.0 adds nothing
        return combine([checksum(_canonical(q), part, shape),
                        checksum(_canonical(scales), Box(first, hull), blocks_of(shape, self.block))])

    def _checksum(self, q, scale, part: Box, shape: tuple) -> int:
        sbox = Box(scale_offset(part.offsets, self.block), blocks_of(part.sizes, self.block))
        return combine([checksum(_canonical(q), part, shape),
                        checksum(_canonical(scale), sbox, blocks_of(shape, self.block))])

    def stored_checksum(self, t: int, shard, shape: tuple) -> int:
        """Of a quantized weight's FP8 storage and scales (every block, however it was quantized) and of the
        parts that arrived in the source's dtype, as they landed."""
        if shard.stored is None or t not in self.wire.quantized:
            return super().stored_checksum(t, shard, shape)
        landing = shard.stored
        sbox = Box(scale_offset(shard.box.offsets, self.block), blocks_of(shard.box.sizes, self.block))
        out = [checksum(_canonical(landing.fp8), shard.box, shape),
               checksum(_canonical(landing.scale), sbox, blocks_of(shape, self.block))]
        for a, _replicas in self.plan.unique_boxes(shape, self.plan.src.placements[t]):
            r = a.intersect(shard.box)
            for part in self.wire.parts(t, r) if r is not None else ():
                if not self.wire.fp8(t, part):
                    out.append(checksum(shard.read(part), part, shape))
        return combine(out)


def _max(a: float | None, b: float) -> float:
    """The larger, NaN if either is (as torch's max over a block)."""
    return b if a is None or b != b or (a == a and b > a) else a


def _canonical(x):
    """FP8 bytes or float32 scales with every NaN as one bit pattern: a block holding a NaN is NaN (vLLM's, and
    `base.fp8`'s), but the sign its NaNs get depends on the order of its reductions."""
    if x.dtype == torch.float32:
        return torch.where(torch.isnan(x), torch.tensor(float("nan"), device=x.device), x)
    bits = x.view(torch.uint8)
    return torch.where(bits & 0x7F == 0x7F, torch.tensor(0x7F, dtype=torch.uint8, device=x.device), bits)


__all__ = ["BlockFP8", "FP8Landing"]
