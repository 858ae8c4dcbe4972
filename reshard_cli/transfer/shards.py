"""A rank's local shards: what it sends (read from a source) and the buffers it receives into.

Destination buffers start as the sentinel byte pattern, so a region no message ever wrote cannot pass the
exact comparison or the checksum: verification proves every byte arrived, not just that nothing was wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reshard_cli.base.fragments import Fragments
from reshard_cli.base.geometry import Box
from reshard_cli.layouts.layout import Layout

SENTINEL_BYTE = 0xA5  # destination buffers start as this pattern: a region never written cannot pass


@dataclass
class LocalShard:
    """A rank's local shard of one tensor: the global box it covers and its data (a view, never a copy; a
    source may be `Fragments`). Where the plan's codec stores its own form at a destination (a quantized
    engine's weight), `stored` is that storage (the codec's landing, `codecs`): items that travel encoded land
    there, `data` takes the ones that arrive in the source's dtype."""

    box: Box
    data: "torch.Tensor | Fragments"
    stored: object = None  # the codec's storage of the box, or None

    def read(self, box: Box) -> torch.Tensor:
        """Global region `box` (inside this shard's box) of the data."""
        if isinstance(self.data, Fragments):
            return self.data.read(box)
        return self.data[box.local_slices(self.box)]


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
