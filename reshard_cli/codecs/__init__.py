"""What an item of a refit carries on the wire and how it lands: a wire codec, chosen by the plan.

The plan says how many bytes each item is on the wire (`plan.Plan.wire`: its `nbytes`, `payload`, and which
items travel encoded); a codec says what those bytes are and what a destination stores. The transfer core
(`transfer.engine`, `transfer.verify`, `transfer.live`) calls only this interface and names no format:

    codec = codec_for(plan)                 # `Plain` (the source's bytes), or the plan's destination format
    codec.encoded(t, box)                   # whether item `box` of tensor `t` travels in the codec's own form
    codec.encode(buf, off, t, box, x)       # sender: the source region `x` into the message at `off`
    codec.forward(buf, off, t, box, shard)  # a destination forwarding what it stores of `box`
    codec.land(buf, off, t, box, shard)     # receiver: the item into the destination's storage
    codec.finish(received, whole, shards)   # once every message landed: what only complete boxes allow
    codec.stores(t)                         # whether a destination of `t` stores the codec's form
    codec.shard(rank, t, box, given)        # that storage: (a buffer for what lands plain, the storage), checked
    codec.agreement(rank, src_shards)       # values every source must share before checksums (or None),
    codec.merge(parts)                      #   and their merge over every rank's
    codec.source_checksum(t, x, r, shape, agreed)   # of region r as the destination will store it
    codec.stored_checksum(t, shard, shape)          # of what a destination stores

Items that are not `encoded` are the source's bytes, moved by the engine itself (the fast path). A new format
(MXFP8, NVFP4) is a module here with a `Codec` subclass, chosen in `codec_for` by what the destination layout
says it stores; the plan's wire (`plan.fp8.Wire` today) says what its items weigh.
"""
from __future__ import annotations

import torch

from reshard_cli.base.checksums import checksum


class Codec:
    """The plain codec: every item is the source's bytes, stored as they arrive."""

    name = "plain"
    converts = False  # whether `finish` has anything to do

    def __init__(self, plan):
        self.plan = plan
        self.wire = plan.wire

    def encoded(self, t: int, box) -> bool:
        return False

    def encode(self, buf: torch.Tensor, off: int, t: int, box, x: torch.Tensor) -> None:
        raise AssertionError("the plain codec encodes nothing")

    def forward(self, buf: torch.Tensor, off: int, t: int, box, shard) -> None:
        raise AssertionError("the plain codec encodes nothing")

    def land(self, buf: torch.Tensor, off: int, t: int, box, shard) -> None:
        raise AssertionError("the plain codec encodes nothing")

    def finish(self, received, whole, shards: dict) -> int:
        """After every message landed: `received` the (tensor, box) items that arrived on the reshard path,
        `whole` the tensors that arrived whole (the broadcast path). Returns the elements it converted."""
        return 0

    def stores(self, t: int) -> bool:
        return False

    def shard(self, rank: int, t: int, box, given) -> tuple:
        raise AssertionError("the plain codec stores the source's bytes")

    def agreement(self, rank: int, src_shards: dict):
        return None

    def merge(self, parts) -> dict | None:
        return None

    def source_checksum(self, t: int, shard, r, shape: tuple, agreed) -> int:
        """Of region `r` of tensor `t` (read from the source's `shard`) as the destination will store it."""
        return checksum(shard.read(r), r, shape)

    def stored_checksum(self, t: int, shard, shape: tuple) -> int:
        return checksum(shard.data, shard.box, shape)

    @staticmethod
    def buffers(x) -> tuple:
        """The tensors behind what a caller passed for one destination box (a codec's landing, or a tensor)."""
        return x.buffers() if hasattr(x, "buffers") else (x,)


def codec_for(plan) -> Codec:
    """The codec of `plan`: the destination's quantized format where its layout names one, else `Plain`."""
    if plan.wire.quantized:
        from reshard_cli.codecs.fp8 import BlockFP8

        return BlockFP8(plan)
    return Codec(plan)


__all__ = ["Codec", "codec_for"]
