"""Staging groups: a refit into an engine that must hold a layer's weights twice while it converts them (a
checkpoint-format copy beside its kernel format) moves the model in groups of whole layers, so that one group is
complete, converted and released before the next one arrives. Both sides of a refit derive the same groups from
the destination layout alone.

A group holds at most `budget` bytes of checkpoint-format tensors on any destination rank; a layer larger than
the budget is a group on its own, so no group exceeds max(budget, the largest layer). Tensors outside the
decoder layers (embeddings, the final norm, the head) form one unit of their own, first."""
from __future__ import annotations

from dataclasses import dataclass

from reshard_cli.formats.base import checked_stage_mb
from reshard_cli.layouts.layout import Layout, layer_indices

DEFAULT_STAGE_MB = 1024.0  # what an engine worker stages at once by default: a few layers of the largest models,
# room beside a full KV cache


@dataclass(frozen=True)
class Group:
    tensors: tuple[int, ...]  # indices into the layout's manifest, in manifest order
    layers: tuple[int, ...]  # decoder layers in the group (sorted)
    outside: bool  # holds the tensors outside the decoder layers
    nbytes: int  # the most checkpoint-format bytes one destination rank holds of it

    @property
    def label(self) -> str:
        parts = ["embeddings/norm/head"] if self.outside else []
        if self.layers:
            a, b = self.layers[0], self.layers[-1]
            parts.append(f"layer {a}" if a == b else f"layers {a}-{b}")
        return " + ".join(parts) or "no tensors"


def layer_groups(dst: Layout, budget: int | None) -> list[Group]:
    """The destination's tensors in groups of whole layers, in layer order, each within `budget` bytes per rank
    (None or 0: one group)."""
    return _grouped(_units(dst), budget)


def _units(dst: Layout) -> tuple[dict, list, dict]:
    """The layers (None: the tensors outside them) with their tensors, in order, and each one's most bytes on
    one destination rank."""
    layer_of = layer_indices(dst.manifest)
    units: dict[int | None, list[int]] = {}
    for t, layer in enumerate(layer_of):
        units.setdefault(layer, []).append(t)
    order = sorted(units, key=lambda k: -1 if k is None else k)
    held: dict[tuple, dict] = {}  # (shape, placement) -> elements per rank, shared by the layers' like tensors
    return units, order, {k: _most_per_rank(dst, units[k], held) for k in order}


def _grouped(unit_sizes: tuple, budget: int | None) -> list[Group]:
    units, order, sizes = unit_sizes
    if not budget:
        return [_group(units, order, sizes)] if order else []
    groups, current, held = [], [], 0
    for k in order:
        if current and held + sizes[k] > budget:
            groups.append(_group(units, current, sizes))
            current, held = [], 0
        current.append(k)
        held += sizes[k]
    if current:
        groups.append(_group(units, current, sizes))
    return groups


def resume_layer(committed: list[Group]) -> int | None:
    """Where a refit resumes after its first groups, `committed`, were committed everywhere: the layer after
    their last one (None: from the start). In layers, not groups: the refit that resumes (a fleet's survivors,
    planned again) may group the layers otherwise."""
    if not committed:
        return None
    return max((layer for g in committed for layer in g.layers), default=-1) + 1


def resume_group(groups: list[Group], layer: int | None) -> int:
    """The first of `groups` a refit resumed at `layer` runs (`resume_layer`): the first holding that layer or a
    later one, the last group if none does (everything was committed: it runs again, so the update ends
    complete); 0 for None."""
    if layer is None or not groups:
        return 0
    return next((i for i, g in enumerate(groups) if g.layers and g.layers[-1] >= layer), len(groups) - 1)


def stage_budget_mb(dst: Layout, stage_mb: float | None = None) -> float:
    """What a refit into `dst` stages per worker at once, in MiB: `stage_mb` (checked: `checked_stage_mb`),
    else the layout's `engine: {stage_mb}` (checked when the layout was read), else DEFAULT_STAGE_MB (0: the
    whole model, one group). The one rule every side of a refit resolves it by, from the same values."""
    for value in (checked_stage_mb(stage_mb), dst.engine.get("stage_mb")):
        if value is not None:
            return float(value)
    return DEFAULT_STAGE_MB


def stage_bytes(stage_mb: float) -> int:
    """A staging budget in MiB as bytes."""
    return int(stage_mb * (1 << 20))


def stage_groups(dst: Layout, stage_mb: float | None = None) -> list[Group]:
    """The staging groups a refit into `dst` runs in (`layer_groups` within `stage_budget_mb`)."""
    return layer_groups(dst, stage_bytes(stage_budget_mb(dst, stage_mb)))


def staging(dst: Layout, stage_mb: float | None = None) -> dict | None:
    """What a refit into `dst`'s engine stages per worker (None when the layout describes no engine): the
    budget (`stage_mb`, else the layout's `engine: {stage_mb}`, else DEFAULT_STAGE_MB), the groups, the most
    one group holds, and what the whole model would hold at once."""
    if not dst.engine:
        return None
    value = stage_budget_mb(dst, stage_mb)
    unit_sizes = _units(dst)
    groups = _grouped(unit_sizes, stage_bytes(value))
    units = _grouped(unit_sizes, 1)
    return {"stage_mb": float(value), "groups": len(groups), "peak_bytes": max((g.nbytes for g in groups), default=0),
            "largest_layer_bytes": max((u.nbytes for u in units), default=0),
            "whole_bytes": sum(u.nbytes for u in units)}


def _group(units: dict, keys: list, sizes: dict) -> Group:
    tensors = tuple(sorted(t for k in keys for t in units[k]))
    return Group(tensors, tuple(k for k in keys if k is not None), None in keys, sum(sizes[k] for k in keys))


def _most_per_rank(layout: Layout, tensors: list[int], held: dict) -> int:
    """The most bytes any rank of `layout` holds of `tensors`. `held`: elements per rank by (shape, placement),
    filled as it goes (the layers of a model repeat a few of them)."""
    per_rank: dict[int, int] = {}
    specs = layout.manifest.tensors
    for t in tensors:
        spec, p = specs[t], layout.placements[t]
        key = (spec.shape, id(p))
        ranks = held.get(key)
        if ranks is None:
            ranks = held[key] = {}
            for box, holders in p.boxes(spec.shape):
                for r in holders:
                    ranks[r] = ranks.get(r, 0) + box.numel
        item = spec.itemsize
        for r, n in ranks.items():
            per_rank[r] = per_rank.get(r, 0) + n * item
    return max(per_rank.values(), default=0)
