"""Layouts: a model manifest + a group of global ranks + named meshes + rules that place every tensor.

    model: qwen3-30b-a3b              # bundled name | config.json | safetensors file/dir/index | YAML tensor list
    ranks: 0-15                       # optional; src defaults to 0.., dst to the ranks right after src
    meshes:                           # or `mesh: {dp: 4, tp: 4}` for one mesh (named "default")
      dense:  {pp: 2, dp: 4, tp: 2}   # row-major over `ranks`: the last dim varies fastest
      expert: {pp: 2, ep: 4, etp: 2}
    pipeline: pp                      # or {dim: pp, layers: [24, 24]}: layer i lives on one stage
    experts: ep                       # or [dp, tp]: expert e lives on one coordinate of these dims (flattened)
    placements:                       # first match wins; mesh dims not named replicate
      - {match: 'experts\\.\\d+\\.(gate|up)_proj', mesh: expert, shard: {etp: 0}}

A tensor's placement on a layout is a `Placement`: the mesh, a Shard dim or None per mesh dim, and the
coordinates fixed by its pipeline stage / expert. Identical placements are shared objects, so the planner
can treat all tensors with the same (shape, dtype, src placement, dst placement) as one class.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import product
from pathlib import Path
from typing import Any, Callable, Mapping

from reshard_cli.base.geometry import Box, shard_box
from reshard_cli.errors import ConfigError
from reshard_cli.layouts.models import Manifest, load_manifest
from reshard_cli.layouts.quant import Quantization, quantization_of
from reshard_cli.layouts.yamlio import check_keys, line_of, parse_ranks

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
EXPERT_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.")
FIRST_STAGE_RE = re.compile(r"embed|wte|word_embeddings")
TOP_KEYS = ("name", "description", "model", "dtype", "ranks", "mesh", "meshes", "pipeline", "experts",
            "placements", "source", "format")  # + the keys the storage formats own (`formats`)
RULE_KEYS = ("match", "mesh", "shard", "pad", "stages")


@dataclass(frozen=True)
class Mesh:
    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # global ranks in row-major coordinate order

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_at(self, coord: tuple[int, ...]) -> int:
        i = 0
        for c, n in zip(coord, self.shape):
            i = i * n + c
        return self.ranks[i]

    def coord_of(self, rank: int) -> tuple[int, ...]:
        i = self.ranks.index(rank)
        out = []
        for n in reversed(self.shape):
            out.append(i % n)
            i //= n
        return tuple(reversed(out))


@dataclass(frozen=True, eq=False)
class Placement:
    """Where one tensor lives in a layout. Compared by identity: the layout interns equal placements."""

    mesh: Mesh
    shard: tuple  # per mesh dim: tensor dim (Shard) or None (Replicate)
    fixed: tuple  # per mesh dim: fixed coordinate (pipeline stage / expert), a tuple of them, or None
    pad: int = 1  # sharded extents are chunked as if padded to a multiple of this (an engine's padded vocab)

    @cached_property
    def coords(self) -> tuple[tuple[int, ...], ...]:
        axes = [range(n) if f is None else f if isinstance(f, tuple) else (f,)
                for n, f in zip(self.mesh.shape, self.fixed)]
        return tuple(product(*axes))

    @cached_property
    def holders(self) -> tuple[int, ...]:
        return tuple(self.mesh.rank_at(c) for c in self.coords)

    @cached_property
    def holder_set(self) -> frozenset:
        return frozenset(self.holders)

    def boxes(self, shape: tuple[int, ...]) -> list[tuple[Box, tuple[int, ...]]]:
        """Unique boxes in first-appearance order, each with the ranks (replicas) holding it."""
        groups: dict[Box, list[int]] = {}
        for c, r in zip(self.coords, self.holders):
            groups.setdefault(shard_box(shape, self.mesh.shape, c, self.shard, self.pad), []).append(r)
        return [(b, tuple(rs)) for b, rs in groups.items()]

    def box_of(self, shape: tuple[int, ...], rank: int) -> Box:
        return shard_box(shape, self.mesh.shape, self.mesh.coord_of(rank), self.shard, self.pad)

    def describe(self) -> str:
        parts = []
        for d, s, f in zip(self.mesh.dims, self.shard, self.fixed):
            if f is not None:
                parts.append(f"{d}={f}")
            elif s is not None:
                parts.append(f"{d}:S({s})")
        return f"{self.mesh.name}[{', '.join(parts) or 'replicate'}]"


@dataclass(frozen=True)
class Rule:
    index: int
    pattern: re.Pattern
    mesh: Mesh
    shard: tuple  # per mesh dim: tensor dim or None
    line: int | None
    pad: int = 1  # see Placement.pad
    stages: tuple = ()  # pipeline stages that hold the matched tensors (negative: from the last), overriding the
    # usual stage (an engine keeps tied embeddings on the first and the last stage)


@dataclass(frozen=True)
class Layout:
    file: str
    name: str
    manifest: Manifest
    ranks: tuple[int, ...]
    meshes: dict[str, Mesh]
    pipeline: str | None
    stage_of_layer: tuple[int, ...]
    experts: tuple[str, ...]
    rules: tuple[Rule, ...]
    placements: tuple[Placement, ...] = field(repr=False)  # one per manifest tensor
    source: Any = None  # raw `source:` mapping (used by `reshard run`)
    format: str = "hf"  # how the framework stores the tensors (reshard_cli.formats)
    expert_order: str = "linear"  # expert e's owner: see expert_owner()
    engine: Mapping = field(default_factory=dict)  # about the engine it runs in: `urls`, `stage_mb` (formats)

    @cached_property
    def quantization(self) -> Quantization | None:
        """How the engine this layout describes quantizes the model (`engine: {quantization: fp8}`), or None."""
        return quantization_of(self.engine.get("quantization"), self.manifest.config, file=self.file,
                               key="engine.quantization", line=None)

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """The running engines this layout describes (`engine: {url: ...}`): one, or a fleet's, in replica order."""
        return tuple(self.engine.get("urls", ()))

    @property
    def engine_url(self) -> str | None:
        """The running engine(s) this layout describes, in words (None: none)."""
        return ", ".join(self.engine_urls) or None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def placement(self, tensor: int) -> Placement:
        return self.placements[tensor]

    def in_order_of(self, manifest: Manifest) -> "Layout":
        """This layout with its tensors (and their placements) in `manifest`'s order, which must list the same
        names: a plan pairs the two layouts' tensors by position."""
        if manifest is self.manifest:
            return self
        names = [t.name for t in manifest.tensors]
        if names == [t.name for t in self.manifest.tensors]:
            return self
        order = [self.manifest.index(n) for n in names]
        reordered = replace(self.manifest, tensors=tuple(self.manifest.tensors[i] for i in order))
        return replace(self, manifest=reordered, placements=tuple(self.placements[i] for i in order))

    def subset(self, tensors) -> "Layout":
        """This layout over some of its tensors only (indices, kept in this layout's order): a refit in groups
        plans each group's tensors on their own."""
        keep = sorted(set(tensors))
        part = replace(self.manifest, tensors=tuple(self.manifest.tensors[i] for i in keep))
        return replace(self, manifest=part, placements=tuple(self.placements[i] for i in keep))

    def held(self, rank: int) -> list[tuple[int, Box]]:
        """(tensor index, global box) of every tensor `rank` holds in this layout, in manifest order."""
        tensors = self.manifest.tensors
        return [(t, p.box_of(tensors[t].shape, rank)) for t, p in enumerate(self.placements)
                if rank in p.holder_set]

    def describe(self) -> str:
        meshes = "; ".join(f"{m.name}=" + "×".join(f"{d}{n}" for d, n in zip(m.dims, m.shape))
                           for m in self.meshes.values())
        return f"{self.name}: {self.size} ranks {self.ranks[0]}-{self.ranks[-1]}, {meshes}"


# ----------------------------------------------------------------------------------------------- loading


def layout_from_doc(doc: dict, *, file: str, first_rank: int = 0, scale: int = 1, format: str = "hf",
                    expand: Callable | None = None, engine: Mapping | None = None,
                    format_keys: tuple = ()) -> Layout:
    """A layout from its document; `file` names it in errors and relative paths resolve against its directory.

    Layouts are read through `reshard_cli.formats` (`load_layout`, `load_pair`, `layout_from_doc`), which
    passes the document's storage format here: its name, `expand(doc, manifest, file)` (the document with
    what the format derives filled in), the engine it describes, and the top-level keys formats own."""
    check_keys(doc, TOP_KEYS + format_keys, file=file, where="", required=("model",))
    if ("mesh" in doc) == ("meshes" in doc):
        raise ConfigError("give exactly one of `mesh:` (one mesh) or `meshes:` (named meshes)", file=file,
                          line=getattr(doc, "line", None))
    manifest = _manifest(doc, file, scale)
    if expand is not None:  # the format writes the meshes and rules from the framework's own arguments
        doc = expand(doc, manifest, file)
    meshes, ranks = _parse_meshes(doc, file, first_rank)
    all_dims = {d for m in meshes.values() for d in m.dims}
    layers = _tensor_indices(manifest)[0]
    num_layers = max((x for x in layers if x is not None), default=-1) + 1
    pipeline, stage_of_layer = _parse_pipeline(doc, file, meshes, all_dims, num_layers)
    experts, expert_order = _parse_experts(doc, file, all_dims)
    rules = _parse_rules(doc, file, meshes)
    placements, used = _place(manifest, rules, meshes, pipeline, stage_of_layer, experts, expert_order, file, doc)
    for r, u in zip(rules, used):
        if not u and expand is None:  # rules a format wrote may match nothing in this model; the user's may not
            raise ConfigError(f"rule matches no tensor of model {manifest.name!r}", file=file,
                              key=f"placements[{r.index}].match", line=r.line)
    name = str(doc.get("name") or Path(file).stem)
    return Layout(file=file, name=name, manifest=manifest, ranks=ranks, meshes=meshes, pipeline=pipeline,
                  stage_of_layer=stage_of_layer, experts=experts, rules=tuple(rules),
                  placements=tuple(placements), source=doc.get("source"), format=format, expert_order=expert_order,
                  engine=dict(engine or {}))


def _manifest(doc: dict, file: str, scale: int) -> Manifest:
    """The model the layout names (`model:`, optionally `dtype:`), relative paths against the layout's folder."""
    model = doc["model"]
    if not isinstance(model, str):
        raise ConfigError("expected a model name or a path", file=file, key="model", line=line_of(doc, "model"))
    dtype = doc.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise ConfigError("expected a dtype name like bfloat16", file=file, key="dtype", line=line_of(doc, "dtype"))
    return load_manifest(model, base_dir=Path(file).parent, dtype=dtype, file=file, key="model", scale=scale)


def _parse_meshes(doc: dict, file: str, first_rank: int) -> tuple[dict[str, Mesh], tuple[int, ...]]:
    """`mesh:` (one mesh, named "default") or `meshes:`, and the group's ranks (`ranks:` or `first_rank`..):
    every mesh spans all of them."""
    raw_meshes = {"default": doc["mesh"]} if "mesh" in doc else doc["meshes"]
    mesh_key = "mesh" if "mesh" in doc else "meshes"
    if not isinstance(raw_meshes, dict) or not raw_meshes:
        raise ConfigError("expected a mapping of meshes", file=file, key=mesh_key, line=line_of(doc, mesh_key))

    def where(mname) -> dict:
        if mesh_key == "mesh":
            return dict(key="mesh", line=line_of(doc, "mesh"))
        return dict(key=f"meshes.{mname}", line=line_of(raw_meshes, mname))

    shapes: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}
    for mname, spec in raw_meshes.items():
        if not isinstance(spec, dict) or not spec:
            raise ConfigError("expected a mapping of dim: size, like {dp: 2, tp: 4}", file=file, **where(mname))
        for d, n in spec.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError("mesh dim size must be a positive integer", file=file,
                                  key=f"{where(mname)['key']}.{d}", line=line_of(spec, d))
        shapes[str(mname)] = (tuple(str(d) for d in spec), tuple(spec.values()))
    sizes = {m: _prod(s) for m, (_, s) in shapes.items()}
    if "ranks" in doc:
        ranks = parse_ranks(doc["ranks"], file=file, key="ranks", line=line_of(doc, "ranks"))
    else:
        ranks = tuple(range(first_rank, first_rank + next(iter(sizes.values()))))
    for m, n in sizes.items():
        if n != len(ranks):
            raise ConfigError(f"mesh product {n} != number of ranks {len(ranks)}", file=file, **where(m))
    return {m: Mesh(m, dims, shape, ranks) for m, (dims, shape) in shapes.items()}, ranks


def _place(manifest: Manifest, rules: list, meshes: dict, pipeline, stage_of_layer, experts, expert_order: str,
           file: str, doc: dict) -> tuple[list[Placement], list[bool]]:
    """The placement of each tensor, and which rules matched any. Everything that decides a placement is
    (rule, ndim, stage, expert owner), so each distinct key is resolved and validated once (50k-tensor models
    share a few hundred placements); equal placements are then one shared object."""
    layers, experts_seen, shapes_of = _tensor_indices(manifest)
    resolved: dict[tuple, Placement] = {}
    placements: list[Placement] = []
    used = [False] * len(rules)
    default_mesh = next(iter(meshes.values()))
    num_experts = max((e for e in experts_seen if e is not None), default=-1) + 1
    rule_of = _rule_matcher(rules, manifest)
    for ti, (t, layer, e) in enumerate(zip(manifest.tensors, layers, experts_seen)):
        rule = rule_of(ti)
        if pipeline is None:
            stage_key = None
        elif layer is not None:
            stage_key = stage_of_layer[layer]
        else:
            stage_key = "first" if FIRST_STAGE_RE.search(t.name) else "last"
        key = (rule.index if rule else -1, shapes_of[ti], stage_key, e if experts else None)
        p = resolved.get(key)
        if p is None:
            p = resolved[key] = _resolve(t, rule, default_mesh, pipeline, stage_of_layer, layer, experts, e,
                                         num_experts, file, doc, expert_order)
            if rule:
                used[rule.index] = True
        placements.append(p)
    # intern equal placements (e.g. the same stage reached through different layers)
    interned: dict[tuple, Placement] = {}
    canon = {id(p): interned.setdefault((p.mesh.name, p.shard, p.fixed, p.pad), p) for p in resolved.values()}
    return [canon[id(p)] for p in placements], used


def _resolve(t, rule, default_mesh, pipeline, stage_of_layer, layer, experts, e, num_experts, file, doc,
             expert_order="linear"):
    """The placement of tensor `t` under `rule`, with its pipeline stage and expert owner fixed."""
    mesh, shard = (rule.mesh, rule.shard) if rule else (default_mesh, (None,) * len(default_mesh.dims))
    key = _rule_key(rule)
    line = rule.line if rule else None
    for d, p in zip(mesh.dims, shard):
        if p is not None and p >= len(t.shape):
            raise ConfigError(f"shard dim {p} out of range for {t.name} with shape {list(t.shape)}",
                              file=file, key=f"{key}.shard.{d}", line=line)
    fixed: list = [None] * len(mesh.dims)
    if pipeline is not None:
        if pipeline not in mesh.dims:
            how = "is placed on" if rule else "matches no rule, so it falls to the first"
            raise ConfigError(f"tensor {t.name} {how} mesh {mesh.name!r}, which has no pipeline dim "
                              f"{pipeline!r}", file=file, key=key,
                              line=line if rule else line_of(doc, "placements"))
        n_stages = mesh.shape[mesh.dims.index(pipeline)]
        if rule and rule.stages:
            chosen = tuple(sorted({s % n_stages for s in rule.stages}))
            stage = chosen[0] if len(chosen) == 1 else chosen
        elif layer is not None:
            stage = stage_of_layer[layer]
        elif FIRST_STAGE_RE.search(t.name):
            stage = 0
        else:
            stage = n_stages - 1
        i = mesh.dims.index(pipeline)
        if shard[i] is not None:
            raise ConfigError(f"mesh dim {pipeline!r} shards {t.name} but is the pipeline dim", file=file,
                              key=key, line=line)
        fixed[i] = stage
    if e is not None and experts:
        missing = [d for d in experts if d not in mesh.dims]
        if missing:
            how = (f"its mesh {mesh.name!r} has" if rule else
                   f"it matches no rule, so it falls to the first mesh {mesh.name!r}, which has")
            raise ConfigError(f"expert tensor {t.name} needs an owner on expert dims {list(experts)}, but {how} "
                              f"no {missing[0]!r}", file=file, key=key,
                              line=line if rule else line_of(doc, "placements"))
        idx = [mesh.dims.index(d) for d in experts]
        n = _prod(mesh.shape[i] for i in idx)
        if num_experts % n and expert_order == "linear":
            raise ConfigError(f"{num_experts} experts do not split evenly over {n} expert coordinates",
                              file=file, key="experts", line=line_of(doc, "experts"))
        flat = expert_owner(e, num_experts, n, expert_order)
        for i in reversed(idx):
            if fixed[i] is not None or shard[i] is not None:
                raise ConfigError(f"mesh dim {mesh.dims[i]!r} is both an expert dim and a shard/pipeline dim "
                                  f"for {t.name}", file=file, key=key, line=line)
            fixed[i] = flat % mesh.shape[i]
            flat //= mesh.shape[i]
    return Placement(mesh, shard, tuple(fixed), rule.pad if rule else 1)


EXPERT_ORDERS = ("linear", "balanced", "round_robin")


def expert_owner(e: int, num_experts: int, n: int, order: str) -> int:
    """The expert coordinate (0..n-1) that owns expert `e`.

    linear: e // (E/n), E divisible by n (Megatron); balanced: contiguous ranges, the first E % n coordinates
    one expert more (vLLM's linear placement, which allows any E); round_robin: e % n (vLLM's round-robin).
    """
    if order == "round_robin":
        return e % n
    base, extra = divmod(num_experts, n)
    if order == "balanced" and extra:
        cut = extra * (base + 1)
        return e // (base + 1) if e < cut else extra + (e - cut) // base
    return e // (num_experts // n)


def check_pair(src: Layout, dst: Layout) -> tuple[Layout, Layout]:
    """A source and a destination layout that can be planned together: groups must not overlap and the models
    must match. Returns them with dst's tensors in src's order (a checkpoint's header order against a config's
    order)."""
    overlap = sorted(set(src.ranks) & set(dst.ranks))
    if overlap:
        raise ConfigError(f"src and dst ranks overlap (rank {overlap[0]}{' and more' if len(overlap) > 1 else ''}); "
                          f"src is {src.ranks[0]}-{src.ranks[-1]}", file=dst.file, key="ranks")
    diff = src.manifest.diff(dst.manifest)
    if diff:
        raise ConfigError(f"src and dst models differ: {'; '.join(diff)}", file=dst.file, key="model")
    return src, dst.in_order_of(src.manifest)


def replicated_doc(doc: dict, replicas: int, *, file: str, urls: list | None = None) -> dict:
    """A layout document for `replicas` copies of its replica: the size of its meshes' `dp` dim (their
    slowest, so that a replica is a contiguous range of ranks) set to `replicas`, or added first where the
    layout has none (the whole layout is then its replica); `ranks:` left out, so the group is numbered again
    (a pair's destination right after its source); with `urls`, its `engine.url` those. The replica's own
    parallelism is unchanged. A layout whose replica cannot be told (`dp` not the slowest dim, or in some of
    its meshes only) is a ConfigError naming its mesh."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ConfigError(f"a fleet has at least one replica, not {replicas!r}", file=file, key="mesh")
    key = "mesh" if "mesh" in doc else "meshes"
    raw = doc.get(key)
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("the replica of a layout is its mesh without `dp`: it needs `mesh:` or `meshes:`",
                          file=file, key=key, line=line_of(doc, key))
    meshes = {"mesh": raw} if key == "mesh" else dict(raw)
    if not all(isinstance(m, dict) and m for m in meshes.values()):
        raise ConfigError("expected a mapping of dim: size, like {dp: 2, tp: 4}", file=file, key=key,
                          line=line_of(doc, key))
    with_dp = [name for name, m in meshes.items() if "dp" in m]
    if with_dp and len(with_dp) < len(meshes):
        missing = next(name for name in meshes if name not in with_dp)
        raise ConfigError(f"cannot tell the replica: mesh {missing!r} has no `dp` dim and {with_dp[0]!r} has one",
                          file=file, key=key, line=line_of(doc, key))
    for name, m in meshes.items():
        if with_dp and next(iter(m)) != "dp":
            where = key if key == "mesh" else f"meshes.{name}"
            raise ConfigError(f"cannot tell the replica: `dp` is not the slowest (first) dim of {list(m)}, so a "
                              f"replica is not a contiguous range of ranks", file=file, key=where,
                              line=line_of(doc, key))
    if len({m["dp"] for m in meshes.values()} if with_dp else ()) > 1:
        raise ConfigError("cannot tell the replica: the meshes' `dp` sizes differ", file=file, key=key,
                          line=line_of(doc, key))

    def grown(m: dict) -> dict:
        out = copy.copy(m)  # a loaded mapping keeps its line numbers
        out.clear()
        out.update({"dp": replicas, **{d: n for d, n in m.items() if d != "dp"}})
        return out

    out = copy.copy(doc)
    out.pop("ranks", None)
    if key == "mesh":
        out["mesh"] = grown(raw)
    else:
        out["meshes"] = copy.copy(raw)
        out["meshes"].update({name: grown(m) for name, m in raw.items()})
    if urls is not None:
        engine = dict(out.get("engine") or {})
        engine["url"] = list(urls) if len(urls) > 1 else urls[0]
        out["engine"] = engine
    return out


def _parse_pipeline(doc, file, meshes, all_dims, num_layers) -> tuple[str | None, tuple[int, ...]]:
    raw = doc.get("pipeline")
    if raw is None:
        return None, ()
    line = line_of(doc, "pipeline")
    layers = None
    if isinstance(raw, dict):
        check_keys(raw, ("dim", "layers"), file=file, where="pipeline", required=("dim",))
        dim, layers = raw["dim"], raw.get("layers")
    else:
        dim = raw
    if not isinstance(dim, str) or dim not in all_dims:
        raise ConfigError(f"unknown mesh dim {dim!r} (dims: {', '.join(sorted(all_dims))})", file=file,
                          key="pipeline", line=line)
    stages = {m.shape[m.dims.index(dim)] for m in meshes.values() if dim in m.dims}
    if len(stages) != 1:
        raise ConfigError(f"meshes disagree on the size of {dim!r}: {sorted(stages)}", file=file, key="pipeline",
                          line=line)
    n = stages.pop()
    if layers is None:
        base, extra = divmod(num_layers, n)
        layers = [base + (1 if s < extra else 0) for s in range(n)]
    elif (not isinstance(layers, list) or len(layers) != n
          or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in layers)
          or sum(layers) != num_layers):
        raise ConfigError(f"expected {n} layer counts summing to the model's {num_layers} layers",
                          file=file, key="pipeline.layers", line=line)
    return dim, tuple(s for s, k in enumerate(layers) for _ in range(k))


def _parse_experts(doc, file, all_dims) -> tuple[tuple[str, ...], str]:
    """`experts: ep`, `[dp, tp]` or `{dims: [dp, tp], order: linear | round_robin}`."""
    raw = doc.get("experts")
    if raw is None:
        return (), "linear"
    order = "linear"
    if isinstance(raw, dict):
        check_keys(raw, ("dims", "order"), file=file, where="experts", required=("dims",))
        order = raw.get("order", "linear")
        if order not in EXPERT_ORDERS:
            raise ConfigError(f"expected one of {', '.join(EXPERT_ORDERS)}, got {order!r}", file=file,
                              key="experts.order", line=line_of(raw, "order"))
        raw = raw["dims"]
    dims = [raw] if isinstance(raw, str) else raw
    if not isinstance(dims, list) or not dims:
        raise ConfigError("expected a mesh dim or a list of mesh dims", file=file, key="experts",
                          line=line_of(doc, "experts"))
    for d in dims:
        if not isinstance(d, str) or d not in all_dims:
            raise ConfigError(f"unknown mesh dim {d!r} (dims: {', '.join(sorted(all_dims))})", file=file,
                              key="experts", line=line_of(doc, "experts"))
    if len(set(dims)) != len(dims):
        raise ConfigError(f"a mesh dim is listed twice: {dims}", file=file, key="experts",
                          line=line_of(doc, "experts"))
    return tuple(dims), order


def _parse_rules(doc, file, meshes) -> list[Rule]:
    raw = doc.get("placements", [])
    if not isinstance(raw, list):
        raise ConfigError("expected a list of rules", file=file, key="placements", line=line_of(doc, "placements"))
    rules = []
    for i, r in enumerate(raw):
        where = f"placements[{i}]"
        check_keys(r, RULE_KEYS, file=file, where=where, required=("match",))
        line = getattr(r, "line", None)
        try:
            pattern = re.compile(str(r["match"]))
        except re.error as e:
            raise ConfigError(f"bad regex: {e}", file=file, key=f"{where}.match", line=line) from None
        if "mesh" in r:
            if not isinstance(r["mesh"], str) or r["mesh"] not in meshes:
                raise ConfigError(f"unknown mesh {r['mesh']!r} (meshes: {', '.join(meshes)})", file=file,
                                  key=f"{where}.mesh", line=line)
            mesh = meshes[r["mesh"]]
        elif len(meshes) == 1:
            mesh = next(iter(meshes.values()))
        else:
            raise ConfigError("several meshes are defined: name one with `mesh:`", file=file, key=where, line=line)
        shard = [None] * len(mesh.dims)
        spec = r.get("shard") or {}
        if not isinstance(spec, dict):
            raise ConfigError("expected a mapping mesh_dim: tensor_dim, like {tp: 0}", file=file,
                              key=f"{where}.shard", line=line)
        for d, td in spec.items():
            if d not in mesh.dims:
                raise ConfigError(f"unknown mesh dim {d!r} for mesh {mesh.name!r} (dims: {', '.join(mesh.dims)})",
                                  file=file, key=f"{where}.shard.{d}", line=line)
            if not isinstance(td, int) or isinstance(td, bool) or td < 0:
                raise ConfigError("tensor dim must be an integer >= 0", file=file, key=f"{where}.shard.{d}",
                                  line=line)
            shard[mesh.dims.index(d)] = td
        pad = r.get("pad", 1)
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 1:
            raise ConfigError("pad must be a positive integer", file=file, key=f"{where}.pad", line=line)
        stages = r.get("stages", [])
        if not isinstance(stages, list) or any(not isinstance(x, int) or isinstance(x, bool) for x in stages):
            raise ConfigError("expected a list of pipeline stages, like [0, -1]", file=file, key=f"{where}.stages",
                              line=line)
        rules.append(Rule(i, pattern, mesh, tuple(shard), line, pad, tuple(stages)))
    return rules


def _rule_key(rule: Rule | None) -> str:
    return f"placements[{rule.index}]" if rule else "placements"


# Per manifest (both layouts of a pair share one): (layer index, expert index, ndim) of every tensor, and the
# tensor names with every digit made '0' (see `_rule_matcher`). Keyed by id, with the manifest kept alive.
_INDICES: dict[int, tuple] = {}
_DIGITS = bytes.maketrans(b"123456789", b"000000000")  # on UTF-8 bytes: only ASCII digits are bytes 0x31-0x39


def layer_indices(manifest: Manifest) -> list[int | None]:
    """Per tensor, its decoder layer N (`layers.N.` in its name), None for a tensor outside the layers."""
    return _tensor_indices(manifest)[0]


def _tensor_indices(manifest: Manifest) -> tuple[list, list, list]:
    hit = _INDICES.get(id(manifest))
    if hit is None or hit[0] is not manifest:
        names = [t.name for t in manifest.tensors]
        hit = (manifest, [_index_after("layers.", n) if "layers." in n else None for n in names],
               [_index_after("experts.", n) if "experts." in n else None for n in names],
               [len(t.shape) for t in manifest.tensors], None)
        if len(_INDICES) > 8:
            _INDICES.clear()
        _INDICES[id(manifest)] = hit
    return hit[1], hit[2], hit[3]


def _digitless_names(manifest: Manifest) -> list[bytes]:
    """Every name, UTF-8 encoded, with each ASCII digit made '0' (lengths kept, so `\\d\\d` still counts)."""
    hit = _INDICES[id(manifest)]  # filled by _tensor_indices
    if hit[4] is None:
        hit = _INDICES[id(manifest)] = (*hit[:4], [t.name.encode().translate(_DIGITS) for t in manifest.tensors])
    return hit[4]


def _rule_matcher(rules: list, manifest: Manifest):
    """tensor index -> the first rule whose pattern matches its name (or None).

    Names differ mostly in layer and expert numbers, and a pattern without a digit (and without a named
    back-reference) cannot tell one digit from another, so such rules match a name exactly when they match
    it with every digit made '0' (a pattern with a digit, a named back-reference or a \\N{...} escape turns
    this off): one search per distinct digitless name instead of one per tensor."""
    names = [t.name for t in manifest.tensors]
    if any(any(ch.isdigit() for ch in r.pattern.pattern) or "(?P=" in r.pattern.pattern or "\\N{" in r.pattern.pattern
           for r in rules):
        return lambda ti: next((r for r in rules if r.pattern.search(names[ti])), None)
    digitless = _digitless_names(manifest)
    memo: dict[bytes, Rule | None] = {}

    def rule_of(ti: int) -> Rule | None:
        key = digitless[ti]
        if key in memo:
            return memo[key]
        name = key.decode()
        r = memo[key] = next((r for r in rules if r.pattern.search(name)), None)
        return r

    return rule_of


def _index_after(word: str, name: str) -> int | None:
    """The number N of the first `word.N.` in `name` that starts the name or follows a '.' — what
    `(?:^|\\.)word\\.(\\d+)\\.` finds (LAYER_RE, EXPERT_RE), without a regex search per tensor."""
    at = name.find(word)
    while at >= 0:
        if at == 0 or name[at - 1] == ".":
            i = j = at + len(word)
            while j < len(name) and name[j].isdecimal():
                j += 1
            if j > i and j < len(name) and name[j] == ".":
                return int(name[i:j])
        at = name.find(word, at + 1)
    return None


def _int_match(rx: re.Pattern, name: str) -> int | None:
    m = rx.search(name)
    return int(m.group(1)) if m else None


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n
