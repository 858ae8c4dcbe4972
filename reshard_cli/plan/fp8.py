"""Refitting an FP8 engine (`layouts.quant`): where each destination block is quantized, and the wire it costs.

A block's FP8 bytes and scale depend on the whole block only (its amax), so whoever holds a whole block can
quantize it. The plan stays in checkpoint space; per tensor it splits the blocks in two:

- **on the sender**: blocks that lie wholly inside one source shard box. The source quantizes them and the
  wire carries one byte per element plus the block's float32 scale;
- **on the receiver**: blocks that a source shard boundary cuts (an FSDP shard of 112 rows cuts every
  128-row block it ends in). Their BF16 moves as today, and the destination quantizes once the block is
  complete.

Per-tensor FP8 is vLLM quantizing a BF16 checkpoint itself, after loading (its online `--quantization fp8`):
the engine's checkpoint-format storage stays BF16, so BF16 moves and the engine quantizes every tensor.

The destination must hold whole blocks, as vLLM requires of a block-FP8 engine (`validate_fp8_block_shape`):
a tensor-parallel split that cuts a block is refused here with the line vLLM would fail with at start-up.
Wire figures come from the plan's own loads (`Plan.stats` with FP8 item sizes), so forwarding, replicas and
routes count exactly as for the BF16 refit beside them.
"""
from __future__ import annotations

import re
from collections import defaultdict

from reshard_cli.base.blocks import blocks_of, grid_split, split_whole, whole_blocks
from reshard_cli.base.geometry import Box
from reshard_cli.errors import ConfigError
from reshard_cli.layouts.quant import MERGED, Quantization
from reshard_cli.plan.terms import Route

_INDEX = re.compile(r"\.\d+\.")
_FLOATS = ("bfloat16", "float16", "float32")
SCALE_ALIGN = 16  # an FP8 item's scales start this aligned after its bytes


class Wire:
    """What each item of a refit's reshard path carries. Into a block-FP8 engine, a part of a quantized tensor
    that holds whole blocks travels quantized: its FP8 bytes, then (at `scale_at`) its blocks' float32 scales,
    made by the sender from its BF16; every other part travels in the source's dtype and the destination
    quantizes the blocks it completes. `parts` splits a piece into the two kinds (the blocks a source shard
    boundary cuts lie wholly in the rim), and `split` cuts a part on the block grid, so that whether an item
    is quantized is a function of its box alone (`fp8`), computed alike by every rank. Without a block-FP8
    destination every item is the source's bytes."""

    def __init__(self, plan):
        specs = plan.src.manifest.tensors
        q = plan.dst.quantization
        self.block = q.block if q is not None else None
        self.shapes = [s.shape for s in specs]
        self.items = [s.itemsize for s in specs]
        self.quantized = frozenset() if self.block is None else frozenset(
            t for t, s in enumerate(specs) if s.dtype in _FLOATS and len(s.shape) >= 2 and q.quantizes(s.name, s.shape))

    def fp8(self, t: int, box: Box) -> bool:
        return t in self.quantized and whole_blocks(box.offsets, box.sizes, self.shapes[t], self.block)

    def parts(self, t: int, box: Box) -> list[Box]:
        """The piece `box` of tensor `t` as the parts that travel: its whole blocks (quantized) and its rim."""
        if t not in self.quantized:
            return [box]
        inner, rim = split_whole(box, self.shapes[t], self.block)
        return ([inner] if inner is not None else []) + rim

    def split(self, t: int, box: Box, k: int) -> list[Box]:
        """`box` in `k` parts (alike on both ends); a quantized part's stay whole blocks."""
        return grid_split(box, k, self.shapes[t], self.block) if self.fp8(t, box) else box.split(k)

    def unquantized_into(self, plan, t: int, box: Box) -> bool:
        """Whether destination box `box` of quantized tensor `t` receives any item unquantized: all of it when
        the tensor is broadcast, else the rims of its intersections with the source boxes (the planner cuts
        forwarded parts on the grid, so they add none)."""
        if plan.routes[t] == Route.BROADCAST:
            return True
        for a, _holders in plan.unique_boxes(self.shapes[t], plan.src.placements[t]):
            r = a.intersect(box)
            if r is not None and split_whole(r, self.shapes[t], self.block)[1]:
                return True
        return False

    def scale_at(self, box: Box) -> int:
        """Where a quantized item's scales start, in bytes from the item's start."""
        return -(-box.numel // SCALE_ALIGN) * SCALE_ALIGN

    def nbytes(self, t: int, box: Box) -> int:
        """The item's bytes on the wire."""
        if not self.fp8(t, box):
            return box.numel * self.items[t]
        n = 1
        for s in blocks_of(box.sizes, self.block):
            n *= s
        return self.scale_at(box) + 4 * n if box.numel else 0

    def payload(self, t: int, box: Box) -> int:
        """What of `nbytes` is data (FP8 bytes and scales, without the gap between them)."""
        n = self.nbytes(t, box)
        return n - (self.scale_at(box) - box.numel) if n and self.fp8(t, box) else n


def check_blocks(layout, q: Quantization) -> None:
    """Every quantized tensor's destination boxes hold whole blocks (a ragged last block counts as whole)."""
    if q.block is None:
        return
    seen = set()
    found = []  # (vLLM refuses it, line): the first of each kind
    for t, spec in enumerate(layout.manifest.tensors):
        p = layout.placements[t]
        key = (spec.shape, id(p))
        if key in seen or not q.quantizes(spec.name, spec.shape):
            continue
        seen.add(key)
        for box, _holders in p.boxes(spec.shape):
            for d, (o, n, b, full) in enumerate(zip(box.offsets, box.sizes, q.block, spec.shape)):
                if box.empty or (o % b == 0 and ((o + n) % b == 0 or o + n == full)):
                    continue
                refused = not (d == 0 and MERGED.search(spec.name))  # vLLM allows a fused layer's row cuts
                what = ("vLLM refuses this engine (its validate_fp8_block_shape)" if refused else
                        "reshard does not yet refit a block vLLM splits between two ranks of a fused layer")
                found.append((refused, f"{spec.name}: a shard of {n} {'rows' if d == 0 else 'columns'} at {o} "
                                       f"cuts its {b}-wide FP8 blocks: {what}; choose a parallelism whose "
                                       f"shards are multiples of {b}"))
                break
            else:
                continue
            break
    if found:
        raise ConfigError(max(found, key=lambda f: f[0])[1], file=layout.file, key="mesh")


def whole_block_share(shape: tuple, boxes: list, block: tuple[int, int]) -> float:
    """The share of a tensor's elements in blocks no source shard boundary cuts (each lies wholly inside one
    box). `boxes`: (Box, holders) pairs tiling the tensor. Conservative where boxes are not a grid: a cut
    through any box counts for every block it passes."""
    if len(shape) != 2:
        return 0.0
    uncut = []
    for d, (n, b) in enumerate(zip(shape, block)):
        cuts = sorted({x for box, _h in boxes for x in (box.offsets[d], box.offsets[d] + box.sizes[d])} - {0, n})
        kept, j = 0, 0
        for start in range(0, n, b):
            end = min(start + b, n)
            while j < len(cuts) and cuts[j] <= start:
                j += 1
            if not (j < len(cuts) and cuts[j] < end):
                kept += end - start
        uncut.append(kept)
    return uncut[0] * uncut[1] / max(shape[0] * shape[1], 1)


def fp8_figures(plan, stats: dict) -> dict | None:
    """The FP8 part of `reshard plan`'s figures (None for a destination that is not FP8). `stats`: the plan's
    own (BF16) figures, for the comparison."""
    q = plan.dst.quantization
    if q is None:
        return None
    check_blocks(plan.dst, q)
    classes, cid = plan.classes.index()
    items = plan.classes.itemsizes()
    share: dict[int, float] = {}
    sender, receiver, other = [], [], []
    kinds: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])  # kind -> tensors, elements, sender elements
    scale_bytes = engine_bytes = quantized = 0
    for t, spec in enumerate(plan.src.manifest.tensors):
        if not q.quantizes(spec.name, spec.shape):
            sender.append(0)
            receiver.append(0)
            other.append(items[t])
            engine_bytes += spec.numel * items[t]
            continue
        i = cid[t]
        if i not in share:
            share[i] = 0.0 if q.block is None else whole_block_share(spec.shape, classes[i].src_boxes, q.block)
        f = share[i]
        scale = q.scale_bytes(spec.shape) if q.block else 4
        sender.append(f * (1 + scale / spec.numel))
        receiver.append((1 - f) * items[t])
        other.append(0)
        quantized += 1
        scale_bytes += scale
        engine_bytes += spec.numel + scale
        k = kinds[_INDEX.sub(".*.", spec.name)]
        k[0] += 1
        k[1] += spec.numel
        k[2] += f * spec.numel
    moved = {name: plan.stats(itemsizes=weights) for name, weights in
             (("sender", sender), ("receiver", receiver), ("other", other))}

    def total(key: str) -> int:
        return round(sum(m[key] for m in moved.values()))

    wire = total("wire_bytes")
    elements = sum(k[1] for k in kinds.values())
    return {
        "scheme": q.describe(),
        "block": list(q.block) if q.block else None,
        "quantized_tensors": quantized,
        "quantized_params": elements,
        "scale_bytes": scale_bytes,
        "engine_model_bytes": engine_bytes,  # the model as the engine keeps it: FP8 weights, scales, the rest
        "sender_share": sum(k[2] for k in kinds.values()) / max(elements, 1),  # of the quantized elements
        "sender_quantized_bytes": round(moved["sender"]["wire_bytes"]),  # wire: FP8 bytes and scales
        "receiver_quantized_bytes": round(moved["receiver"]["wire_bytes"]),  # wire: BF16 of cut blocks
        "unquantized_bytes": round(moved["other"]["wire_bytes"]),  # wire: embeddings, norms, router, lm_head
        "wire_bytes": wire,
        "bf16_wire_bytes": stats["wire_bytes"],
        "wire_ratio": wire / max(stats["wire_bytes"], 1),
        "forwarded_bytes": total("forwarded_bytes"),
        "indomain_bytes": total("indomain_bytes"),
        "by_kind": {name: {"tensors": n, "params": e, "sender_share": s / max(e, 1)}
                    for name, (n, e, s) in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
    }
