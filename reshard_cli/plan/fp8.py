"""Refitting an FP8 engine (`layouts.quant`): where each destination block is quantized, and the wire it costs.

A block's FP8 bytes and scale depend on the whole block only (its amax), so whoever holds a whole block can
quantize it. The plan stays in checkpoint space; per tensor it splits the blocks in two:

- **on the sender**: blocks that lie wholly inside one source shard box. The source quantizes them and the
  wire carries one byte per element plus the block's float32 scale;
- **on the receiver**: blocks that a source shard boundary cuts (an FSDP shard of 112 rows cuts every
  128-row block it ends in). Their BF16 moves as today, and the destination quantizes once the block is
  complete.

Per-tensor FP8 (a checkpoint's `weight_scale`, or vLLM's online `fp8_per_tensor`) needs the whole tensor's
amax, which no sender holding a shard has: BF16 moves, and the engine quantizes every tensor with the maximum
the refit group agrees (`layouts.quant`). vLLM's online `fp8_per_block` quantizes on the block grid of each
engine shard, which the layout checks is the checkpoint tensor's: the senders quantize, as for a block-FP8
checkpoint.

The destination must hold whole blocks, as vLLM requires of a block-FP8 engine (`validate_fp8_block_shape`):
a tensor-parallel split that cuts a block is refused here with the line vLLM would fail with at start-up.
Wire figures come from the plan's own loads (`Plan.stats` with `wire_weights`), so forwarding, replicas and
routes count exactly as for the BF16 refit beside them, piece by piece: a piece's whole blocks weigh one byte
per element plus 4 per block (their scales), its rim the source dtype, as the transport sends them (`Wire`).
A broadcast tensor moves in the source dtype (the engine quantizes it), and so does the gather->broadcast
baseline: the full-tensor path RL frameworks use broadcasts BF16 and leaves the quantizing to the engine.
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
SCALE_BYTES = 4  # a block's float32 scale
# what `TensorClass.columns` may count per piece besides its elements (`counter`)
WHOLE = "fp8"  # the bytes its whole blocks travel as: one per element and a scale per block
INNER = "inner"  # the elements of its whole blocks
# `reshard plan`'s figures that weigh the bytes on the wire: into a block-FP8 engine, kept as bf16_<key> too
HEADLINE = ("wire_bytes", "min_wire_bytes", "indomain_bytes", "forwarded_bytes", "max_rank_send_bytes",
            "max_rank_recv_bytes", "ideal_rank_send_bytes", "ideal_rank_recv_bytes")


def quantized_tensors(manifest, q: Quantization | None) -> frozenset:
    """The tensors a block-FP8 engine keeps quantized (float weights of at least 2 dims it quantizes)."""
    if q is None or q.block is None:
        return frozenset()
    return frozenset(t for t, s in enumerate(manifest.tensors)
                     if s.dtype in _FLOATS and len(s.shape) >= 2 and q.quantizes(s.name, s.shape))


def quantized_of(classes) -> frozenset:
    """`quantized_tensors` of a layout pair's classes (kept with them)."""
    return classes.memo(("quantized",), lambda: quantized_tensors(classes.src.manifest, classes.dst.quantization))


def counter(count: str, shape: tuple, block: tuple[int, int] | None):
    """A function of a piece's box (remembering its answers) for `TensorClass.columns(count=...)`: the
    elements of the box's whole blocks (`INNER`), or the bytes those travel as quantized (`WHOLE`)."""
    if block is None or count not in (WHOLE, INNER):
        raise ValueError(f"nothing to count as {count!r} without a block-FP8 destination")
    seen: dict[Box, int] = {}
    (rows, cols), (bm, bn) = shape[-2:], block

    def count_of(box: Box) -> int:
        v = seen.get(box)
        if v is None:
            (r0, c0), (nr, nc) = box.offsets[-2:], box.sizes[-2:]
            if r0 % bm or c0 % bn or ((r0 + nr) % bm and r0 + nr != rows) or ((c0 + nc) % bn and c0 + nc != cols):
                inner = split_whole(box, shape, block)[0]  # not whole blocks: its inner part is
                if inner is None:
                    seen[box] = 0
                    return 0
                (nr, nc) = inner.sizes[-2:]
            v = box.numel * nr * nc // max(box.sizes[-2] * box.sizes[-1], 1)  # the inner part's elements
            if v and count == WHOLE:
                v += SCALE_BYTES * (v // (nr * nc)) * -(-nr // bm) * -(-nc // bn)
            seen[box] = v
        return v

    return count_of


def _cuts(c, block: tuple[int, int]) -> str:
    """How the source boxes of class `c` meet the block grid: "whole" (every box holds whole blocks), "cut"
    (no block lies wholly inside any box) or "mixed"."""
    boxes = [a for a, _h in c.src_boxes]
    if all(whole_blocks(a.offsets, a.sizes, c.shape, block) for a in boxes):
        return "whole"
    return "mixed" if any(split_whole(a, c.shape, block)[0] is not None for a in boxes) else "cut"


def wire_weights(classes) -> dict:
    """What `Plan.stats(wire=...)` and the cost model weigh the reshard path with: per count of
    `TensorClass.columns` (None: elements), per tensor the bytes per unit counted, so that a piece of a
    quantized tensor weighs its whole blocks' FP8 bytes and scales plus its rim in the source dtype, and any
    other piece its elements in the source dtype. Empty when nothing travels quantized (a BF16 engine).

    Where every piece of a tensor is whole blocks of full size (its class's source boxes hold whole blocks and
    its dims are multiples of the block), a piece's bytes are its elements times (1 + 4 / block elements):
    that weight, a power-of-two fraction, stands in for counting its blocks (the product stays a whole number
    of bytes, and sums of them exact). Its other pieces are counted (`counter`)."""
    return classes.memo(("wire weights",), lambda: _wire_weights(classes))


def cuts_of(classes) -> dict[int, str]:
    """How the classes of the quantized tensors meet the block grid (`_cuts`), by class index."""
    def make():
        cls, cid = classes.index()
        block = classes.dst.quantization.block
        out: dict[int, str] = {}
        for t in quantized_of(classes):
            if cid[t] not in out:
                out[cid[t]] = _cuts(cls[cid[t]], block)
        return out

    return classes.memo(("cuts",), make)


def _full_blocks(c, block: tuple[int, int]) -> bool:
    """Whether every piece of class `c` (whose source boxes hold whole blocks) is whole blocks of full size: its
    dims are multiples of the block and its destination boxes hold whole blocks (as vLLM requires)."""
    rows, cols = c.shape[-2:]
    return rows % block[0] == 0 and cols % block[1] == 0 and all(
        whole_blocks(b.offsets, b.sizes, c.shape, block) for b, _h in c.dst_boxes)


def _wire_weights(classes) -> dict:
    quantized = quantized_of(classes)
    if not quantized:
        return {}
    cls, cid = classes.index()
    cuts = cuts_of(classes)
    items = classes.itemsizes()
    n = len(items)
    main, inner, whole = list(items), [0] * n, [0] * n
    bm, bn = classes.dst.quantization.block
    per_block = bm * bn
    factor = 1 + SCALE_BYTES / per_block if per_block & (per_block - 1) == 0 else None  # exact only then
    full: dict[int, bool] = {}
    for t in quantized:
        i = cid[t]
        kind = cuts[i]
        if kind == "whole":  # every piece is whole blocks
            if i not in full:
                full[i] = factor is not None and _full_blocks(cls[i], (bm, bn))
            if full[i]:
                main[t] = factor
            else:
                main[t], whole[t] = 0, 1
        elif kind == "mixed":  # elements in the source dtype, less the whole blocks', plus those as FP8
            inner[t], whole[t] = -items[t], 1
    return {k: v for k, v in ((None, main), (INNER, inner), (WHOLE, whole)) if any(v)} | {None: main}


def wire_of(plan) -> dict | None:
    """`Plan.stats(wire=...)` for `plan`: None where everything travels in the source dtype."""
    return wire_weights(plan.classes) or None


def on_wire(plan, stats: dict | None = None) -> dict:
    """`plan.stats()` with the figures that weigh the wire (`HEADLINE`) in the bytes that travel: into a
    block-FP8 engine FP8 and scales where the senders quantize (`wire_weights`), each also kept as
    `bf16_<key>` (the source dtype's, from `stats` when given); the gather->broadcast baseline stays in the
    source dtype. Any other destination: the plan's own figures."""
    stats = stats or plan.stats()
    wire = wire_weights(plan.classes)
    if not wire:
        return stats
    out = plan.stats(wire=wire)
    out.update({f"bf16_{k}": stats[k] for k in HEADLINE})
    return out


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
        self.quantized = quantized_tensors(plan.src.manifest, q)
        self._plan = plan

    @property
    def cut(self) -> frozenset:
        """The quantized tensors with blocks a source shard boundary cuts (quantized by the destination once
        complete, whatever their route): those with a source box that is not whole blocks."""
        out = self.__dict__.get("_cut")
        if out is None:
            plan, out = self._plan, set()
            for t in self.quantized:
                if any(not whole_blocks(a.offsets, a.sizes, self.shapes[t], self.block)
                       for a, _h in plan.unique_boxes(self.shapes[t], plan.src.placements[t])):
                    out.add(t)
            out = self.__dict__["_cut"] = frozenset(out)
        return out

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
    own, in the source dtype (`plan.stats()`) or on the wire (`on_wire`, which keeps the source dtype's
    as `bf16_<key>`), for the comparison."""
    q = plan.dst.quantization
    if q is None:
        return None
    check_blocks(plan.dst, q)
    classes, cid = plan.classes.index()
    items = plan.classes.itemsizes()
    specs = plan.src.manifest.tensors
    quantized = quantized_of(plan.classes) if q.block else frozenset(
        t for t, spec in enumerate(specs) if q.quantizes(spec.name, spec.shape))
    share: dict[int, tuple] = {}  # class -> (its sender share, its scale bytes)
    kinds: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])  # kind -> tensors, elements, sender elements
    scale_bytes = engine_bytes = 0
    for t, spec in enumerate(specs):
        i = cid[t]
        numel = classes[i].numel
        if t not in quantized:
            engine_bytes += numel * items[t]
            continue
        if i not in share:
            share[i] = (_sender_share(classes[i], q.block), q.scale_bytes(spec.shape) if q.block else 4)
        f, scale = share[i]
        scale_bytes += scale
        engine_bytes += numel + scale
        k = kinds[_INDEX.sub(".*.", spec.name)]
        k[0] += 1
        k[1] += numel
        k[2] += f * numel
    sender, receiver, other = _wire_by_kind(plan, quantized)
    wire = sender + receiver + other
    bf16 = stats.get("bf16_wire_bytes", stats["wire_bytes"])
    elements = sum(k[1] for k in kinds.values())
    return {
        "scheme": q.describe(),
        "block": list(q.block) if q.block else None,
        "quantized_tensors": len(quantized),
        "quantized_params": elements,
        "scale_bytes": scale_bytes,
        "engine_model_bytes": engine_bytes,  # the model as the engine keeps it: FP8 weights, scales, the rest
        "sender_share": sum(k[2] for k in kinds.values()) / max(elements, 1),  # of the quantized elements
        "sender_quantized_bytes": sender,  # wire: FP8 bytes and scales
        "receiver_quantized_bytes": receiver,  # wire: BF16 of cut blocks (and of broadcast tensors)
        "unquantized_bytes": other,  # wire: embeddings, norms, router, lm_head
        "wire_bytes": wire,
        "bf16_wire_bytes": bf16,
        "wire_ratio": wire / max(bf16, 1),
        "by_kind": {name: {"tensors": n, "params": e, "sender_share": s / max(e, 1)}
                    for name, (n, e, s) in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
    }


def _sender_share(c, block: tuple[int, int] | None) -> float:
    """The share of class `c`'s elements in blocks that lie wholly inside one source box."""
    if block is None:
        return 0.0
    cuts = _cuts(c, block)
    return 1.0 if cuts == "whole" else 0.0 if cuts == "cut" else whole_block_share(c.shape, c.src_boxes, block)


def _wire_by_kind(plan, quantized: frozenset) -> tuple[int, int, int]:
    """The plan's network bytes of (the blocks the senders quantize: FP8 and scales; the rest of the quantized
    tensors, which travel in the source dtype and the engine quantizes; the tensors it keeps unquantized), as
    `Plan.group_wire_bytes` weighs one group of every tensor."""
    classes, cid = plan.classes.index()
    items = plan.classes.itemsizes()
    wire = wire_weights(plan.classes) or None
    units: dict[tuple, int] = {}  # (class, route, count) -> network units per tensor
    out = [0, 0, 0]
    cuts = cuts_of(plan.classes) if wire is not None else {}
    for t, (i, route) in enumerate(zip(cid, plan.routes)):
        kind = 2 if t not in quantized else 1
        if route == Route.BROADCAST:
            out[kind] += classes[i].bcast_wire(t % classes[i].bn) * items[t]
            continue
        for count, weights in (wire or {None: items}).items():
            w = weights[t]
            if w:
                n = units.get((i, route, count))
                if n is None:
                    col = classes[i].columns(route == Route.DIRECT, count)
                    n = units[(i, route, count)] = col.fixed_loads.wire + col.rotating.wire
                sent = count == WHOLE or (kind == 1 and cuts.get(i) == "whole")  # quantized by the sender
                out[0 if sent else kind] += n * w
    return round(out[0]), round(out[1]), round(out[2])
