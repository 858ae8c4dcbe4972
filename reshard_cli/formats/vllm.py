"""vLLM's storage of a checkpoint: which rank holds which part of each HF tensor, and where it sits.

Plans stay in checkpoint space (HF names and shapes): that is what `reshard plan` reports and what the
minimum-bytes argument is about. This format says two things about a vLLM deployment:

1. `expand()`: the placement of every checkpoint tensor, written in the layout vocabulary (meshes, pipeline
   split, expert owners, rules) exactly as vLLM shards it, so the user writes only the engine's parallelism:

       model: qwen3-30b-a3b
       format: vllm
       mesh: {dp: 4, tp: 4}                 # any of dp, pp, tp, in vLLM's rank order (tp fastest)
       engine: {expert_parallel: true, expert_placement: linear}   # --enable-expert-parallel, its strategy

   - column-parallel q/gate/up (and MLA's q_b/kv_b) split rows over tp, row-parallel o/down split columns;
   - k/v split by kv head; with tp > kv heads each head is replicated tp/kv times (rank r keeps head
     r // (tp/kv)), which is a `kvh × kvr` view of the tp dim;
   - embed_tokens and lm_head split over tp as vLLM pads the vocabulary: to a multiple of 64, then equal
     parts (the padding rows exist in the engine only);
   - pipeline stages split layers as vLLM's `get_pp_indices` does (the remainder goes to the middle stages,
     last-but-one first);
   - routed experts: TP-sharded like dense MLPs, or, with expert parallelism, whole experts over the
     dp × tp ranks, `linear` (expert e on rank e // (E/ep)) or `round_robin` (e % ep);
   - norms, routers, MLA's a-projections: replicated.

2. `storage()`: the engine's own tensors on one rank (`qkv_proj` = [q; k; v] of this rank, `gate_up_proj` =
   [gate; up], MLA's `fused_qkv_a_proj` = [q_a; kv_a_with_mqa], experts stacked as `experts.routed_experts.w13_weight [E_local, 2·I_local, H]` and
   `w2_weight [E_local, H, I_local]` (vLLM 0.32's names),
   a padded vocab), each with the views of checkpoint boxes it is made of. A transfer writes every received
   piece straight into those views: no full tensor, no second copy.
"""
from __future__ import annotations

import re

from reshard_cli.base.geometry import chunk_size
from reshard_cli.errors import ConfigError
from reshard_cli.formats import derived
from reshard_cli.formats.base import Format, checked_stage_mb, doc_line, format_mesh, format_options, storage_summary
from reshard_cli.formats.storage import EngineTensor, View  # noqa: F401 - re-exported
from reshard_cli.layouts.models import ARCHITECTURES
from reshard_cli.layouts.quant import quantization_of

VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
EXPERT_STACK = "routed_experts"  # vLLM 0.32's FusedMoE keeps the stacked experts under mlp.experts.routed_experts
ENGINE_KEYS = ("all2all_backend", "expert_parallel", "expert_placement", "kind", "quantization", "stage_mb", "url")
# vLLM 0.32's MoE all2all backends (`--all2all-backend`; `naive` and `pplx` fall back to the default there), each
# with whether vLLM runs MoE layers sequence-parallel under it (`ParallelConfig.use_sequence_parallel_moe`, with
# expert parallelism over dp > 1 replicas of tp > 1): tests/test_vllm_contract.py holds this to vLLM's own
ALL2ALL = {"allgather_reducescatter": True, "deepep_high_throughput": True, "deepep_low_latency": True,
           "deepep_v2": True, "flashinfer_nvlink_one_sided": True, "mori_high_throughput": True,
           "mori_low_latency": True, "nixl_ep": True, "passthrough": True, "naive": True, "pplx": True,
           "moonep": False, "flashinfer_nvlink_two_sided": False, "flashinfer_all2allv": False}
DIMS = ("dp", "pp", "tp")

# checkpoint-name patterns (HF naming, as the manifests list them)
_COLUMN = r"(q_proj|gate_proj|up_proj|q_b_proj|kv_b_proj)\.(weight|bias)$|experts\.\d+\.(w1|w3)\.weight$"
_ROW = r"(o_proj|down_proj)\.weight$|experts\.\d+\.w2\.weight$"  # Mixtral's experts: w1 gate, w3 up, w2 down
_KV = r"(k_proj|v_proj)\.(weight|bias)$"
_VOCAB = r"embed_tokens\.weight$|lm_head\.weight$"
_EXPERT = r"(mlp|block_sparse_moe)\.experts\.\d+\."
_SHARED = r"mlp\.shared_experts\."  # DeepSeek-V3 / Kimi-K2's shared experts, in MoE layers only


def vllm_pp_layers(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage as vLLM's `get_pp_indices` splits them (without VLLM_PP_LAYER_PARTITION)."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def expand(doc: dict, manifest, file: str) -> dict:
    """The layout document with vLLM's meshes, pipeline split, expert owners and placement rules filled in."""
    dims = format_mesh(doc, "vllm", DIMS, ("meshes", "placements", "pipeline", "experts"), "engine", file)
    mesh = doc["mesh"]
    engine = format_options(doc, "engine", ENGINE_KEYS, file)
    engine_block(doc, file)  # checked here with the other keys
    ep = bool(engine.get("expert_parallel", False))
    if ep and not ({"dp", "tp"} & set(dims)):
        raise ConfigError("expert parallelism spreads experts over the dp x tp ranks; this mesh has neither",
                          file=file, key="engine.expert_parallel", line=_line(engine, "expert_parallel"))
    backend = all2all_backend(engine, file)
    order = engine.get("expert_placement", "linear")
    if order not in ("linear", "round_robin"):
        raise ConfigError(f"expected linear or round_robin, got {order!r}", file=file,
                          key="engine.expert_placement", line=_line(engine, "expert_placement"))
    config = manifest.config or {}
    if not config:
        raise ConfigError(f"`format: vllm` needs the model's HF config (heads, vocab); {manifest.name!r} has "
                          f"none: name a bundled model or a config.json", file=file, key="model")
    if config.get("model_type") not in ARCHITECTURES:
        return _expand_derived(doc, manifest, file, dims, ep, order, config, backend)
    quantization_of(engine.get("quantization"), config, file=file, key="engine.quantization",
                    line=_line(engine, "quantization"))  # checked against the model here; kept by `engine_block`
    tp = int(mesh.get("tp", 1))
    heads = int(config.get("num_attention_heads", 0))
    kv = int(config.get("num_key_value_heads") or heads)
    mla = "kv_lora_rank" in config
    if heads and heads % tp:
        raise ConfigError(f"tp {tp} does not divide the model's {heads} attention heads", file=file, key="mesh.tp",
                          line=_line(doc, "mesh"))
    meshes: dict = {"default": dict(mesh)}
    rules: list[dict] = []
    if ep and any(re.search(_EXPERT, t.name) for t in manifest.tensors):
        rules.append({"match": _EXPERT, "mesh": "default"})  # whole experts, one owner each
    if sequence_parallel_moe(mesh, ep, backend):
        rules.append({"match": _SHARED, "mesh": "default"})  # whole on every rank, as vLLM keeps them there
    if not mla and kv and tp > 1:
        rules.append(_kv_rule(doc, meshes, tp, kv, file))
    tied = bool(config.get("tie_word_embeddings")) and not any(t.name.endswith("lm_head.weight")
                                                                for t in manifest.tensors)
    if tied and "pp" in mesh:  # the last stage computes logits with the embedding: vLLM keeps it there too
        rules.append({"match": r"embed_tokens\.weight$", "mesh": "default", "shard": {"tp": 0}, "pad": VOCAB_PAD,
                      "stages": [0, -1]})
    rules += [{"match": _VOCAB, "mesh": "default", "shard": {"tp": 0}, "pad": VOCAB_PAD},
              {"match": _COLUMN, "mesh": "default", "shard": {"tp": 0}},
              {"match": _ROW, "mesh": "default", "shard": {"tp": 1}}]
    if "tp" not in mesh:
        rules = [{k: v for k, v in r.items() if k != "shard"} for r in rules]
    out = {k: v for k, v in doc.items() if k not in ("mesh", "engine")}
    out["meshes"] = meshes
    out["placements"] = rules
    if "pp" in mesh:
        layers = int(config.get("num_hidden_layers", 0))
        out["pipeline"] = {"dim": "pp", "layers": vllm_pp_layers(layers, int(mesh["pp"]))}
    if ep:
        out["experts"] = {"dims": [d for d in ("dp", "tp") if d in mesh], "order": effective_placement(order, config)}
    return out


def sequence_parallel_moe(mesh: dict, ep: bool, backend: str = derived.ALL2ALL_DEFAULT) -> bool:
    """Whether vLLM runs MoE layers sequence-parallel (`ParallelConfig.use_sequence_parallel_moe`): expert
    parallelism over dp > 1 replicas of tp > 1 under an all2all backend that does (`ALL2ALL`), at any number of
    pipeline stages (DeepSeek's MoE block reads the flag as it is). Each rank then holds shared experts whole."""
    return ep and ALL2ALL[backend] and int(mesh.get("dp", 1)) > 1 and int(mesh.get("tp", 1)) > 1


def all2all_backend(engine: dict, file: str) -> str:
    """`engine.all2all_backend` (vLLM's `--all2all-backend`), checked against vLLM's names; the default where
    it is not given."""
    backend = engine.get("all2all_backend", derived.ALL2ALL_DEFAULT)
    if not isinstance(backend, str) or backend not in ALL2ALL:
        raise ConfigError(f"unknown all2all backend {backend!r} (vLLM's: {', '.join(sorted(ALL2ALL))})", file=file,
                          key="engine.all2all_backend", line=_line(engine, "all2all_backend"))
    return backend


def _expand_derived(doc: dict, manifest, file: str, dims: list, ep: bool, order: str, config: dict,
                    backend: str) -> dict:
    """A family without hand rules: its placements inferred from vLLM's storage map (`formats.derived`)."""
    mesh, engine = doc["mesh"], doc.get("engine") or {}
    family = config.get("model_type")
    pp = int(mesh.get("pp", 1))
    if engine.get("quantization"):
        raise ConfigError(f"an FP8 engine of a family without hand rules ({family!r}) is not supported yet",
                          file=file, key="engine.quantization", line=_line(engine, "quantization"))
    placement = "round_robin" if effective_placement(order, config) == "round_robin" else "linear"
    dp = int(mesh.get("dp", 1)) if ep else 1
    m = derived.maps_for(config, int(mesh.get("tp", 1)), ep, placement, manifest, file, dp, pp,
                         derived.all2all_of(backend, dp))
    expert = [{"match": _EXPERT, "mesh": "default"}] if ep and any(re.search(_EXPERT, t.name) for t in manifest.tensors) else []
    try:
        layers = derived.pipeline_layers(m, manifest) if pp > 1 else None
        rules, meshes = derived.rules(m, manifest, dict(mesh), config, _EXPERT if expert else None)
    except ConfigError as e:
        raise ConfigError(str(e).removeprefix("model: "), file=file, key="model") from None
    out = {k: v for k, v in doc.items() if k not in ("mesh", "engine")}
    out["meshes"] = {"default": dict(mesh), **meshes}
    out["placements"] = expert + rules
    if layers:
        out["pipeline"] = {"dim": "pp", "layers": layers}
    if ep:
        out["experts"] = {"dims": [d for d in ("dp", "tp") if d in mesh], "order": effective_placement(order, config)}
    return out


def _kv_rule(doc: dict, meshes: dict, tp: int, kv: int, file: str) -> dict:
    """How vLLM splits k/v by kv head: over tp when kv divides by it; with tp > kv heads each head is
    replicated tp/kv times, a `kvh × kvr` view of the tp dim (a mesh of its own, added to `meshes`)."""
    if tp > kv:
        if tp % kv:
            raise ConfigError(f"tp {tp} is neither a divisor nor a multiple of the model's {kv} kv heads",
                              file=file, key="mesh.tp", line=_line(doc, "mesh"))
        kv_mesh = {d: n for d, n in doc["mesh"].items() if d != "tp"}
        kv_mesh.update(kvh=kv, kvr=tp // kv)
        meshes["kv"] = kv_mesh
        return {"match": _KV, "mesh": "kv", "shard": {"kvh": 0}}
    if kv % tp:
        raise ConfigError(f"tp {tp} does not divide the model's {kv} kv heads", file=file, key="mesh.tp",
                          line=_line(doc, "mesh"))
    return {"match": _KV, "mesh": "default", "shard": {"tp": 0}}


def engine_block(doc: dict, file: str) -> dict:
    """`engine: {kind: vllm, url: http://host:port, stage_mb: 1024, quantization: fp8}`: a running `vllm serve`
    that `reshard run` pushes into (or a fleet of them: `url: [URL, URL]`, whose replicas the layout's `dp`
    lists in order), the checkpoint-format MiB each of its workers stages at once during an update, and
    whether it serves the model in FP8 (`layouts.quant`)."""
    engine = doc.get("engine") or {}
    stage = checked_stage_mb(engine.get("stage_mb"), "engine.stage_mb", file, _line(engine, "stage_mb"))
    return {"urls": _engine_urls(engine, file), "stage_mb": stage, "quantization": engine.get("quantization"),
            "all2all_backend": all2all_backend(engine, file)}


def _engine_urls(engine, file: str) -> tuple[str, ...]:
    kind = engine.get("kind", "vllm")
    if kind != "vllm":
        raise ConfigError(f"`format: vllm` runs in a vllm engine, not {kind!r}", file=file, key="engine.kind",
                          line=_line(engine, "kind"))
    given = engine.get("url")
    if given is None:
        return ()
    urls = given if isinstance(given, list) and given else [given]
    for url in urls:
        if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
            raise ConfigError(f"expected an http(s) URL of a running vllm serve (or a list of them), got {url!r}",
                              file=file, key="engine.url", line=_line(engine, "url"))
    out = tuple(u.rstrip("/") for u in urls)
    if len(set(out)) < len(out):
        raise ConfigError(f"{next(u for u in out if out.count(u) > 1)} is listed twice", file=file,
                          key="engine.url", line=_line(engine, "url"))
    return out


def effective_placement(requested: str, config: dict) -> str:
    """The expert order vLLM really uses. Its `linear` gives the first E % ep ranks one expert more
    (`balanced` here); `round_robin` holds only for grouped routing (n_group > 1, no redundant experts):
    otherwise vLLM falls back to linear, and so does this layout (vLLM logs a warning when it does)."""
    grouped = int(config.get("n_group") or config.get("num_expert_group") or 1) > 1
    if requested == "round_robin" and grouped and not config.get("num_redundant_experts"):
        return "round_robin"
    return "balanced"


_line = doc_line


# ------------------------------------------------------------------------------------------- engine storage


_FUSED = (  # vLLM name part, [(HF name part, ...)] stacked along dim 0 in this order
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
    ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),  # MLA with q_lora_rank (replicated)
)
_EXPERT_RE = re.compile(r"^(?P<pre>.*\.(mlp|block_sparse_moe)\.experts)\.(?P<e>\d+)\."
                        r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's names


def storage(layout, rank: int) -> list[EngineTensor]:
    """The engine tensors `rank` keeps, each with the checkpoint views it is made of (this rank's boxes)."""
    if not derived.known(layout):
        return derived.storage(layout, rank)
    tensors = layout.manifest.tensors
    held = dict(layout.held(rank))
    done: set[int] = set()  # checkpoint tensors already placed in a fused or stacked engine tensor
    out = _fused(layout, held, done) + _expert_stacks(tensors, held, done)
    # everything else keeps its checkpoint name; a padded vocab keeps its padded length
    for t, box in held.items():
        if t in done:
            continue
        p = layout.placements[t]
        shape = tuple(box.sizes)
        if p.pad > 1 and re.search(_VOCAB, tensors[t].name):
            shape = (_padded_part(tensors[t].shape[0], p), *shape[1:])
        region = tuple(slice(0, s) for s in box.sizes)
        out.append(EngineTensor(tensors[t].name, shape, tensors[t].dtype, (View(t, box, region),)))
    order_of = {name: i for i, name in enumerate(t.name for t in tensors)}
    out.sort(key=lambda et: min(order_of[tensors[v.tensor].name] for v in et.views))
    q = layout.quantization
    if q is None or not q.stored_fp8:
        return out  # BF16 checkpoint format (`fp8_per_tensor`: vLLM quantizes it after loading)
    if q.block is None:
        return _fp8_tensor_storage(out, tensors, q)
    if q.online:  # fp8_per_block: vLLM quantizes each rank's local tensor; the senders may only where grids meet
        _check_grids(out, tensors, q, layout, rank)
    return _fp8_storage(out, tensors, q)


def _fp8_tensor_storage(out: list[EngineTensor], tensors, q) -> list[EngineTensor]:
    """A per-tensor FP8 checkpoint's engine storage (vLLM's `Fp8LinearMethod` / `Fp8MoEMethod` without
    `weight_block_size`): a quantized engine tensor keeps its shape in `float8_e4m3fn`, followed by its float32
    `weight_scale`, one slot per checkpoint tensor it holds as vLLM's loader places the checkpoint's scalars:
    a fused tensor's member i at [i] (`qkv_proj.weight_scale [3]`), stacked expert j's gate and up at [j, 0]
    and [j, 1] (`w13_weight_scale [E, 2]`), its down at [j] (`w2_weight_scale [E]`)."""
    res = []
    for et in out:
        if not any(q.quantizes(tensors[v.tensor].name, tensors[v.tensor].shape) for v in et.views):
            res.append(et)
            continue
        res.append(EngineTensor(et.name, et.shape, "float8_e4m3fn", et.views))
        stacked = len(et.shape) == 3
        slots = 2 if et.name.endswith("w13_weight") else 1
        if stacked:
            scales = tuple(View(v.tensor, v.box, (v.region[0], slice(k % slots, k % slots + 1)) if slots > 1
                                else (slice(v.region[0], v.region[0] + 1),)) for k, v in enumerate(et.views))
            shape = (et.shape[0], slots) if slots > 1 else (et.shape[0],)
        else:
            scales = tuple(View(v.tensor, v.box, (slice(k, k + 1),)) for k, v in enumerate(et.views))
            shape = (len(et.views),)
        res.append(EngineTensor(et.name.removesuffix("weight") + "weight_scale", shape, "float32", (), scales))
    return res


def _check_grids(out: list[EngineTensor], tensors, q, layout, rank: int) -> None:
    """`fp8_per_block`: vLLM quantizes each rank's local, fused tensor per block (`per_block_cast_to_fp8` in
    its online methods), so its blocks are a checkpoint tensor's only where each view starts on the block grid
    in both and a partial block ends both the checkpoint tensor and the engine tensor. Then its storage after
    processing is a block-FP8 checkpoint's, and the senders quantize; elsewhere one ConfigError. Routed experts
    need whole blocks throughout: vLLM pads their dims to multiples of the block under this method."""
    bm, bn = q.block
    for et in out:
        for v in et.views:
            spec = tensors[v.tensor]
            if not q.quantizes(spec.name, spec.shape):
                continue
            *_lead, r, c = v.region
            for o, n, full, start, engine, b, what in (
                    (v.box.offsets[-2], v.box.sizes[-2], spec.shape[-2], r.start, et.shape[-2], bm, "rows"),
                    (v.box.offsets[-1], v.box.sizes[-1], spec.shape[-1], c.start, et.shape[-1], bn, "columns")):
                ragged_end = o + n == full and start + n == engine and len(et.shape) == 2  # (vLLM pads experts)
                if o % b or start % b or (n % b and not ragged_end):
                    raise ConfigError(
                        f"rank {rank}: {spec.name}: {n} {what} at {o}, at {start} of {et.name}: vLLM's fp8_per_block "
                        f"quantizes each rank's local tensor in {b}-wide blocks, which here are not the checkpoint "
                        f"tensor's; reshard refits fp8_per_block where every shard holds whole {b}x{b} blocks: "
                        f"choose a parallelism whose shards are multiples of {b}, or fp8_per_tensor",
                        file=layout.file, key="engine.quantization")


def _fp8_storage(out: list[EngineTensor], tensors, q) -> list[EngineTensor]:
    """A block-FP8 engine's storage (vLLM's FP8 method on an FP8 checkpoint, or `fp8_per_block` once processed):
    a quantized engine tensor keeps its shape in `float8_e4m3fn`, followed by its float32 `weight_scale_inv`,
    one scale per block of each checkpoint tensor. A fused tensor's members keep their own block grids, stacked
    as vLLM's loader places them (a member at row r starts at scale row ceil(r / bm)); stacked experts per
    expert likewise."""
    bm, bn = q.block
    res = []
    for et in out:
        if not any(q.quantizes(tensors[v.tensor].name, tensors[v.tensor].shape) for v in et.views):
            res.append(et)
            continue
        res.append(EngineTensor(et.name, et.shape, "float8_e4m3fn", et.views))
        scales, rows = [], 0
        for v in et.views:
            *lead, r, c = v.region
            top, height = -(-r.start // bm), -(-(r.stop - r.start) // bm)
            scales.append(View(v.tensor, v.box, (*lead, slice(top, top + height), slice(0, -(-(c.stop - c.start) // bn)))))
            rows = max(rows, top + height)
        shape = (*et.shape[:-2], rows, -(-et.shape[-1] // bn))
        res.append(EngineTensor(et.name.removesuffix("weight") + "weight_scale_inv", shape, "float32", (), tuple(scales)))
    return res


def _fused(layout, held: dict, done: set) -> list[EngineTensor]:
    """Fused projections (`_FUSED`): the rank's local parts of each member stacked along dim 0."""
    tensors = layout.manifest.tensors
    out = []
    for t, box in held.items():
        name = tensors[t].name
        if _EXPERT_RE.match(name):  # routed experts are stacked by `_expert_stacks`, not fused one by one
            continue
        for fused, parts in _FUSED:
            suffix = next((s for s in (".weight", ".bias") if name.endswith(f"{parts[0]}{s}")), None)
            if suffix is None:
                continue
            stem = name[: -len(parts[0] + suffix)]
            members = [layout.manifest.index(stem + p + suffix) if layout.manifest.get(stem + p + suffix) else None
                       for p in parts]
            if any(m is None or m not in held for m in members):
                continue
            views, row = [], 0
            for m in members:
                b = held[m]
                views.append(View(m, b, (slice(row, row + b.sizes[0]),) + tuple(slice(0, s) for s in b.sizes[1:])))
                row += b.sizes[0]
                done.add(m)
            rest = held[members[0]].sizes[1:]
            out.append(EngineTensor(stem + fused + suffix, (row, *rest), tensors[t].dtype, tuple(views)))
    return out


def _expert_stacks(tensors, held: dict, done: set) -> list[EngineTensor]:
    """Routed experts stacked per layer, this rank's experts in global order: w13 = [gate; up], w2 = down."""
    stacks: dict[str, dict] = {}
    for t, box in held.items():
        m = _EXPERT_RE.match(tensors[t].name)
        if m and t not in done:
            st = stacks.setdefault(m["pre"], {})
            st.setdefault(int(m["e"]), {})[_EXPERT_PROJ.get(m["proj"], m["proj"])] = (t, box)
    out = []
    for pre, experts in stacks.items():
        order = sorted(experts)
        first = experts[order[0]]
        if set(first) != {"gate_proj", "up_proj", "down_proj"}:
            continue
        g, d = first["gate_proj"][1], first["down_proj"][1]
        w13, w2 = [], []
        for j, e in enumerate(order):
            parts = experts[e]
            (tg, bg), (tu, bu), (td, bd) = parts["gate_proj"], parts["up_proj"], parts["down_proj"]
            w13.append(View(tg, bg, (j, slice(0, bg.sizes[0]), slice(0, bg.sizes[1]))))
            w13.append(View(tu, bu, (j, slice(bg.sizes[0], bg.sizes[0] + bu.sizes[0]), slice(0, bu.sizes[1]))))
            w2.append(View(td, bd, (j, slice(0, bd.sizes[0]), slice(0, bd.sizes[1]))))
            done.update((tg, tu, td))
        dtype = tensors[first["gate_proj"][0]].dtype
        out.append(EngineTensor(f"{pre}.{EXPERT_STACK}.w13_weight", (len(order), 2 * g.sizes[0], g.sizes[1]), dtype,
                                tuple(w13)))
        out.append(EngineTensor(f"{pre}.{EXPERT_STACK}.w2_weight", (len(order), d.sizes[0], d.sizes[1]), dtype,
                                tuple(w2)))
    return out


def _padded_part(n: int, placement) -> int:
    """Rows of one TP rank's part of a vocab of `n` rows padded as vLLM pads it (one mesh dim shards it)."""

    parts = 1
    for s, size in zip(placement.shard, placement.mesh.shape):
        if s == 0:
            parts *= size
    return chunk_size(n, parts, placement.pad)


def summary(layout, rank: int | None = None) -> dict:
    """What one destination rank's engine storage holds (the group's first rank unless given): engine tensors,
    their bytes, the checkpoint bytes that land in them through views, and how many tensors are fused or
    stacked. Every checkpoint byte a rank holds has a view, so all of it is written in place."""
    rank = layout.ranks[0] if rank is None else rank
    tensors = storage(layout, rank)
    s = storage_summary(layout, tensors, rank)
    specs = layout.manifest.tensors
    held = dict(layout.held(rank))
    through = {v.tensor for et in tensors for v in et.views if v.transform is not None}
    staged = sum(held[t].numel * specs[t].itemsize for t in through)
    return {"format": "vllm", "rank": rank, "engine_tensors": len(tensors), "engine_bytes": s["total_bytes"],
            "checkpoint_bytes": sum(b.numel * specs[t].itemsize for t, b in held.items()),
            "direct_bytes": s["direct_bytes"] - sum(v.box.numel * specs[v.tensor].itemsize for et in tensors
                                                    for v in et.views if v.transform is not None),
            "padding_bytes": s["padding_bytes"], "fused_tensors": sum(len(et.views) > 1 for et in tensors),
            "staged_bytes": staged, "staged_tensors": len(through), "derived": not derived.known(layout)}


def bind(params: dict, layout, rank: int, staged: list | None = None) -> dict:
    """This rank's destination buffers as views into a live vLLM model's parameters (`named_parameters()`),
    keyed by checkpoint tensor name, ready for `Refit` (which writes into them in place). Every engine tensor
    the layout expects must exist with its shape and dtype; otherwise one ConfigError names the first mismatch
    (a parameter vLLM has repacked into a kernel format shows up here as a shape mismatch). A checkpoint
    tensor that lands through a transform or in several regions (`formats.derived`) gets a staging buffer of
    its box instead, a `derived.Staged` appended to `staged`, whose `apply()` writes it into the views."""
    import torch

    names = [t.name for t in layout.manifest.tensors]
    out, through = {}, []
    device = None
    for et in storage(layout, rank):
        p = params.get(et.name)
        if p is None:
            close = [n for n in params if n.rsplit(".", 2)[-2:] == et.name.rsplit(".", 2)[-2:]][:1]
            raise ConfigError(f"rank {rank}: the engine has no parameter {et.name!r}"
                              + (f" (it has {close[0]!r})" if close else ""), key="dst")
        data = p.data if isinstance(p, torch.nn.Parameter) else p
        if tuple(data.shape) != et.shape or str(data.dtype).removeprefix("torch.") != et.dtype:
            raise ConfigError(f"rank {rank}: engine parameter {et.name} is {list(data.shape)} {data.dtype}, the layout "
                              f"expects {list(et.shape)} {et.dtype}"
                              + (" (repacked into a kernel format: reload it first)" if data.numel() == 0 else ""),
                              key="dst")
        device = data.device
        for v in et.views:
            if v.transform is not None:
                through.append((data, v))
                continue
            view = data[v.region]
            if not view.is_contiguous():
                raise ConfigError(f"rank {rank}: {et.name}{list(v.region)} is not contiguous", key="dst")
            out[names[v.tensor]] = view.view(v.box.sizes)  # (a derived region may drop the box's extent-1 dims)
    out.update(derived.bind_staged(through, layout, rank, staged, device or "cpu", out))
    return out


FORMAT = Format(name="vllm", description="a vLLM engine's fused and stacked tensors, placed as vLLM shards them",
                keys={"engine": "describes a vLLM deployment (expert parallelism, a running server)"}, expand=expand, engine=engine_block, storage=storage, bind=bind, summary=summary)
