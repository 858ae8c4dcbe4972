"""One source box kept in several places of a framework's storage (Megatron interleaves q, k and v per query
group). Read by transfers and built by the formats that bind live framework tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reshard_cli.base.geometry import Box


@dataclass
class Fragments:
    """One source box kept in several places of a framework's storage (Megatron interleaves q, k and v per
    query group): `parts` = ((sub-box, tensor view), ...) tiling `box`. Read-only: a source, never a buffer."""

    box: Box
    parts: tuple

    @property
    def shape(self) -> tuple:
        return self.box.sizes

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0][1].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0][1].device

    def is_contiguous(self) -> bool:
        return False

    def detach(self) -> "Fragments":
        return self

    def read(self, box: Box) -> torch.Tensor:
        """Global region `box`: a view when one part holds all of it, else assembled from the parts."""
        for sub, data in self.parts:
            if box.intersect(sub) == box:
                return data[box.local_slices(sub)]
        out = torch.empty(box.sizes, dtype=self.dtype, device=self.device)
        for sub, data in self.parts:
            common = box.intersect(sub)
            if common is not None and not common.empty:
                out[common.local_slices(box)].copy_(data[common.local_slices(sub)])
        return out
