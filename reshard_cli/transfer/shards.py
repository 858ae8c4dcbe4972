"""A rank's local shards: what it sends (read from a source) and the buffers it receives into.

Destination buffers start as the sentinel byte pattern, so a region no message ever wrote cannot pass the
exact comparison or the checksum: verification proves every byte arrived, not just that nothing was wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reshard_cli.base.fragments import Fragments
from reshard_cli.base.geometry import Box
from reshard_cli.layouts.layout import Layout

SENTINEL_BYTE = 0xA5  # destination buffers start as this pattern: a region never written cannot pass


@dataclass
class LocalShard:
    """A rank's local shard of one tensor: the global box it covers and its data (a view, never a copy; a
    source may be `Fragments`). A block-FP8 engine's weight (`FP8Landing`) also has `fp8` and `scale`, its
    storage: quantized items land there, `data` takes the ones that arrive in the source's dtype."""

    box: Box
    data: "torch.Tensor | Fragments"
    fp8: torch.Tensor | None = None  # the box's FP8 bytes (float8_e4m3fn), engine storage
    scale: torch.Tensor | None = None  # its blocks' float32 scales

    def read(self, box: Box) -> torch.Tensor:
        """Global region `box` (inside this shard's box) of the data."""
        if isinstance(self.data, Fragments):
            return self.data.read(box)
        return self.data[box.local_slices(self.box)]

    def read_fp8(self, box: Box, block: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """A block-FP8 weight's storage of global region `box` (whole blocks, inside this shard's box, which is
        on the block grid): its FP8 bytes and its scales."""
        rel = box.relative_to(self.box)
        blocks = tuple(slice(o // b, -(-(o + n) // b)) for o, n, b in zip(rel[-2:], box.sizes[-2:], block))
        lead = tuple(slice(o, o + n) for o, n in zip(rel[:-2], box.sizes[:-2]))
        return self.fp8[box.local_slices(self.box)], self.scale[lead + blocks]


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


def read_source_shards(layout: Layout, rank: int, source, device: torch.device) -> dict[int, LocalShard]:
    """The shards `rank` holds in the source layout, read from `source` (one `read_many` call)."""
    wanted = layout.held(rank)
    return {t: LocalShard(box, data.to(device)) for (t, box), data in zip(wanted, source.read_many(wanted))}


def sentinel_buffers(layout: Layout, rank: int, device: torch.device) -> dict[int, LocalShard]:
    """Fresh destination buffers for the shards `rank` holds in the destination layout, sentinel-filled."""
    tensors = layout.manifest.tensors
    out = {t: LocalShard(box, torch.empty(box.sizes, dtype=getattr(torch, tensors[t].dtype), device=device))
           for t, box in layout.held(rank)}
    fill_sentinel(out.values())
    return out


def fill_sentinel(shards) -> None:
    """Overwrite every byte of these shards with the sentinel."""
    for sh in shards:
        if sh.data.numel():
            sh.data.reshape(-1).view(torch.uint8).fill_(SENTINEL_BYTE)
