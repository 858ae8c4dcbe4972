"""A framework's own tensors on one rank, each with the views of checkpoint boxes it is made of.

Shared by every storage format (vLLM's engine tensors, Megatron's parameters): a transfer reads from or writes
into those views, so no full tensor and no converted copy of the model is ever built.
"""
from __future__ import annotations

from dataclasses import dataclass

from reshard_cli.layouts.models import DTYPE_SIZES


@dataclass(frozen=True)
class View:
    """Checkpoint tensor `tensor`'s global box `box` lands in `region` (slices) of an engine tensor."""

    tensor: int
    box: object  # base.geometry.Box
    region: tuple  # slices into the engine tensor
    transform: str | None = None  # None: the box is written straight into the region; else the box lands in a
    # staging buffer and is written through this transform (`formats.derived.apply_transform`; "copy": as is)


@dataclass(frozen=True)
class EngineTensor:
    """One tensor of the engine on one rank: its name, local shape, dtype, and the views that fill it."""

    name: str
    shape: tuple
    dtype: str
    views: tuple  # (View, ...)
    scales: tuple = ()  # an FP8 engine's scale tensor: (View, ...) whose regions (in blocks) hold the scales of
    # the checkpoint boxes' blocks, quantized into another engine tensor (`formats.vllm`)

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for s in self.shape:
            n *= s
        return n
