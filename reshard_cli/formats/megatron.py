"""Megatron-core's storage of a checkpoint: which trainer rank holds which part of each HF tensor, and where.

Plans stay in checkpoint (HF) space, as for `format: vllm`. This format says three things about a Megatron-core
GPTModel:

1. `expand()`: the placement of every checkpoint tensor in the layout vocabulary, from Megatron's own
   parallel arguments, so the user writes only those:

       model: qwen3-30b-a3b
       format: megatron
       mesh: {pp: 2, dp: 4, tp: 2}          # the dense grid: any of pp, dp, cp, tp (Megatron's order: tp fastest)
       megatron:                            # optional; Megatron's argument names
         expert_model_parallel_size: 4      # EP: experts folded onto the same ranks (grid pp × edp × ep × etp)
         expert_tensor_parallel_size: 2     # ETP (default: tp)
         make_vocab_size_divisible_by: 128  # Megatron pads the vocabulary to a multiple of this × tp
         num_layers_in_first_pipeline_stage: 3   # uneven pipelines (or `pipeline_layers: [..]`, one per stage)

   - column-parallel q/k/v, gate/up (dense and shared experts), MLA's q_b/kv_b split rows over tp; o_proj and
     down split columns; routed experts whole over ep (expert e on ep rank e // (E/ep)), split over etp;
   - embeddings and output layer split over tp after padding the vocabulary (the padding rows exist only in
     Megatron's storage);
   - layers split over pp evenly (or as given); embeddings on the first stage, final norm and output layer on
     the last; DP and CP replicate; norms, routers and MLA's down-projections are replicated.

2. `storage()`: Megatron's own parameters on one rank (`named_parameters()` names: stage-local layer numbers,
   EP-local expert numbers) with the views of checkpoint boxes each is made of: `linear_qkv` interleaves
   [q heads of group g; k_g; v_g] per query group, `linear_fc1` is [gate; up] of this rank, experts are
   `mlp.experts.local_experts.K`. `bind()` turns a live model's parameters into the per-checkpoint-tensor
   views a `Refit` reads from (a q box spread over several groups becomes `Fragments`): no gather, no copy.

3. `global_views()`: where each checkpoint tensor sits in Megatron's *distributed checkpoint* (`torch_dist`):
   the sharded-state-dict key (global layer number, `mlp.experts.experts.linear_fc1.weight` with a leading
   expert axis, norms under their fused-layer keys) and the region inside that key's global tensor.
   `MegatronDistSource` reads checkpoint boxes through it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from reshard_cli.base.geometry import Box, chunk_size
from reshard_cli.errors import ConfigError
from reshard_cli.formats.base import Format, doc_line, format_mesh, format_options, known_family, storage_summary
from reshard_cli.formats.storage import EngineTensor, View
from reshard_cli.layouts.layout import layout_from_doc

DIMS = ("pp", "dp", "cp", "tp")  # dense grid, slowest first (Megatron's default order tp-cp-ep-dp-pp)
MEGATRON_KEYS = ("expert_model_parallel_size", "expert_tensor_parallel_size", "make_vocab_size_divisible_by",
                 "padded_vocab_size", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                 "pipeline_layers")
DEFAULT_VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by default

_EXPERT = r"mlp\.experts\.\d+\."
_KV_NAMES = r"self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)$"
VOCAB = r"embed_tokens\.weight$|lm_head\.weight$"  # tensors whose rows Megatron pads


_line = doc_line


def _int(opts: dict, key: str, file: str, default=None, minimum: int = 1):
    v = opts.get(key, default)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ConfigError(f"expected an integer >= {minimum}, got {v!r}", file=file, key=f"megatron.{key}",
                          line=_line(opts, key))
    return v


def megatron_pp_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per pipeline stage as Megatron splits them: evenly, or with the first / last stage given and the
    rest even. Raises ValueError (with Megatron's condition) when the split is impossible."""
    if pp == 1:
        return [num_layers]
    fixed = [x for x in (first, last) if x is not None]
    middle = pp - len(fixed)
    rest = num_layers - sum(fixed)
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise ValueError(f"{num_layers} layers do not split over {pp} pipeline stages"
                         + (f" with first/last stage {first}/{last}" if fixed else " evenly"))
    each = rest // middle if middle else 0
    parts = [each] * pp
    if first is not None:
        parts[0] = first
    if last is not None:
        parts[-1] = last
    return parts


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    """Megatron's `_vocab_size_with_padding`: round up to a multiple of divisor × tp."""
    m = divisor * tp
    return -(-vocab // m) * m


def expand(doc: dict, manifest, file: str) -> dict:
    """The layout document with Megatron's meshes, pipeline split, expert owners and placement rules."""
    format_mesh(doc, "megatron", DIMS, ("meshes", "placements", "pipeline", "experts", "engine"), "megatron", file)
    mesh = doc["mesh"]
    opts = format_options(doc, "megatron", MEGATRON_KEYS, file)
    config = manifest.config or {}
    if not config:
        raise ConfigError(f"`format: megatron` needs the model's HF config (heads, vocab); {manifest.name!r} has "
                          f"none: name a bundled model or a config.json", file=file, key="model")
    known_family(config, "megatron", "Megatron-core", file)
    tp, pp = int(mesh.get("tp", 1)), int(mesh.get("pp", 1))
    world = 1
    for n in mesh.values():
        world *= int(n)
    ep = _int(opts, "expert_model_parallel_size", file, 1)
    etp = _int(opts, "expert_tensor_parallel_size", file, tp)
    arch = Arch.of(config)
    where = dict(file=file, key="mesh.tp", line=_line(doc, "mesh"))
    if arch.heads % tp:
        raise ConfigError(f"tp {tp} does not divide the model's {arch.heads} attention heads", **where)
    if not arch.mla and arch.groups % tp:
        raise ConfigError(f"tp {tp} does not divide the model's {arch.groups} query groups (Megatron shards whole "
                          f"groups)", **where)
    has_experts = any(re.search(_EXPERT, t.name) for t in manifest.tensors)
    if (ep > 1 or etp != tp) and not has_experts:
        raise ConfigError(f"model {manifest.name!r} has no routed experts to spread", file=file,
                          key="megatron.expert_model_parallel_size", line=_line(opts, "expert_model_parallel_size"))
    if world % (pp * ep * etp):
        raise ConfigError(f"the expert grid pp {pp} × ep {ep} × etp {etp} does not divide the {world} ranks",
                          file=file,
                          key="megatron.expert_model_parallel_size", line=_line(opts, "expert_model_parallel_size"))
    if has_experts and arch.experts % ep:
        raise ConfigError(f"ep {ep} does not divide the model's {arch.experts} experts", file=file,
                          key="megatron.expert_model_parallel_size", line=_line(opts, "expert_model_parallel_size"))
    vocab_pad = _vocab_pad(opts, arch, tp, file)
    dense = {d: int(n) for d, n in mesh.items()}
    expert = {k: v for k, v in (("pp", pp), ("edp", world // (pp * ep * etp)), ("ep", ep), ("etp", etp))
              if k == "ep" or v > 1 or k == "pp" and "pp" in dense}
    meshes = {"dense": dense, "expert": expert} if has_experts else {"dense": dense}
    tp_shard = (lambda d: {"tp": d}) if "tp" in dense else (lambda d: None)
    etp_shard = (lambda d: {"etp": d}) if etp > 1 else (lambda d: None)
    rules: list[dict] = []
    if has_experts:
        rules += [{"match": _EXPERT + r"(gate|up)_proj\.weight$", "mesh": "expert", "shard": etp_shard(0)},
                  {"match": _EXPERT + r"down_proj\.weight$", "mesh": "expert", "shard": etp_shard(1)}]
    column = (r"(q_proj|k_proj|v_proj|gate_proj|up_proj|q_b_proj|kv_b_proj)\.(weight|bias)$")
    rules += [{"match": VOCAB, "mesh": "dense", "shard": tp_shard(0), "pad": vocab_pad},
              {"match": column, "mesh": "dense", "shard": tp_shard(0)},
              {"match": r"(o_proj|down_proj)\.weight$", "mesh": "dense", "shard": tp_shard(1)},
              {"match": ".", "mesh": "dense"}]
    rules = [{k: v for k, v in r.items() if v is not None} for r in rules]
    out = {k: v for k, v in doc.items() if k not in ("mesh", "megatron")}
    out["meshes"] = meshes
    out["placements"] = rules
    if pp > 1:
        out["pipeline"] = {"dim": "pp", "layers": _stage_layers(opts, arch.layers, pp, file)}
    if has_experts and ep > 1:
        out["experts"] = {"dims": ["ep"], "order": "linear"}
    return out


def _vocab_pad(opts: dict, arch: "Arch", tp: int, file: str) -> int:
    """The `pad` of the vocab rules: the padded vocabulary itself (each tp rank then holds padded / tp rows)."""
    given = _int(opts, "padded_vocab_size", file)
    divisor = _int(opts, "make_vocab_size_divisible_by", file, DEFAULT_VOCAB_DIVISOR)
    want = padded_vocab(arch.vocab, divisor, tp) if given is None else given
    if want < arch.vocab or want % tp:
        raise ConfigError(f"padded vocabulary {want} must be >= the model's {arch.vocab} and divisible by tp {tp}",
                          file=file, key="megatron.padded_vocab_size", line=_line(opts, "padded_vocab_size"))
    return want


def _stage_layers(opts: dict, num_layers: int, pp: int, file: str) -> list[int]:
    explicit = opts.get("pipeline_layers")
    if explicit is not None:
        if (not isinstance(explicit, list) or len(explicit) != pp or sum(explicit) != num_layers
                or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in explicit)):
            raise ConfigError(f"expected {pp} layer counts summing to the model's {num_layers} layers", file=file,
                              key="megatron.pipeline_layers", line=_line(opts, "pipeline_layers"))
        return list(explicit)
    first = _int(opts, "num_layers_in_first_pipeline_stage", file, minimum=0)
    last = _int(opts, "num_layers_in_last_pipeline_stage", file, minimum=0)
    try:
        return megatron_pp_layers(num_layers, pp, first, last)
    except ValueError as e:
        raise ConfigError(f"{e}; set megatron.num_layers_in_first/last_pipeline_stage or pipeline_layers as the "
                          f"trainer does", file=file, key="mesh.pp") from None


# ------------------------------------------------------------------------------------------ the model's shape


@dataclass(frozen=True)
class Arch:
    """What the storage mapping needs from the HF config."""

    heads: int
    groups: int
    head_dim: int
    vocab: int
    layers: int
    experts: int
    mla: bool

    @classmethod
    def of(cls, config: dict) -> "Arch":
        heads = int(config.get("num_attention_heads") or 1)
        hidden = int(config.get("hidden_size") or 0)
        head_dim = int(config.get("head_dim") or (hidden // heads if hidden else 0))
        return cls(heads=heads, groups=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
                   vocab=int(config.get("vocab_size") or 0), layers=int(config.get("num_hidden_layers") or 0),
                   experts=int(config.get("num_experts") or config.get("num_local_experts")
                               or config.get("n_routed_experts") or 0),
                   mla="kv_lora_rank" in config)


# ------------------------------------------------------------------------------------------ names

# HF name inside a layer -> (Megatron name inside the layer, fused kind, member index). `{e}` is the expert.
_LAYER_NAMES = [
    (r"input_layernorm\.weight", "input_layernorm.weight", None, 0),
    (r"post_attention_layernorm\.weight", "pre_mlp_layernorm.weight", None, 0),
    (r"self_attn\.q_proj\.(weight|bias)", "self_attention.linear_qkv.{1}", "qkv", 0),
    (r"self_attn\.k_proj\.(weight|bias)", "self_attention.linear_qkv.{1}", "qkv", 1),
    (r"self_attn\.v_proj\.(weight|bias)", "self_attention.linear_qkv.{1}", "qkv", 2),
    (r"self_attn\.o_proj\.weight", "self_attention.linear_proj.weight", None, 0),
    (r"self_attn\.q_norm\.weight", "self_attention.q_layernorm.weight", None, 0),
    (r"self_attn\.k_norm\.weight", "self_attention.k_layernorm.weight", None, 0),
    # MLA (DeepSeek-V3, Kimi-K2)
    (r"self_attn\.q_a_proj\.weight", "self_attention.linear_q_down_proj.weight", None, 0),
    (r"self_attn\.q_a_layernorm\.weight", "self_attention.q_layernorm.weight", None, 0),
    (r"self_attn\.q_b_proj\.weight", "self_attention.linear_q_up_proj.weight", None, 0),
    (r"self_attn\.kv_a_proj_with_mqa\.weight", "self_attention.linear_kv_down_proj.weight", None, 0),
    (r"self_attn\.kv_a_layernorm\.weight", "self_attention.kv_layernorm.weight", None, 0),
    (r"self_attn\.kv_b_proj\.weight", "self_attention.linear_kv_up_proj.weight", None, 0),
    # MLP, dense and MoE
    (r"mlp\.gate_proj\.weight", "mlp.linear_fc1.weight", "glu", 0),
    (r"mlp\.up_proj\.weight", "mlp.linear_fc1.weight", "glu", 1),
    (r"mlp\.down_proj\.weight", "mlp.linear_fc2.weight", None, 0),
    (r"mlp\.gate\.weight", "mlp.router.weight", None, 0),
    (r"mlp\.gate\.e_score_correction_bias", "mlp.router.expert_bias", None, 0),
    (r"mlp\.experts\.(\d+)\.gate_proj\.weight", "mlp.experts.local_experts.{e}.linear_fc1.weight", "glu", 0),
    (r"mlp\.experts\.(\d+)\.up_proj\.weight", "mlp.experts.local_experts.{e}.linear_fc1.weight", "glu", 1),
    (r"mlp\.experts\.(\d+)\.down_proj\.weight", "mlp.experts.local_experts.{e}.linear_fc2.weight", None, 0),
    (r"mlp\.shared_experts?\.gate_proj\.weight", "mlp.shared_experts.linear_fc1.weight", "glu", 0),
    (r"mlp\.shared_experts?\.up_proj\.weight", "mlp.shared_experts.linear_fc1.weight", "glu", 1),
    (r"mlp\.shared_experts?\.down_proj\.weight", "mlp.shared_experts.linear_fc2.weight", None, 0),
    (r"mlp\.shared_expert_gate\.weight", "mlp.shared_experts.gate_weight", None, 0),
]
_LAYER_RES = [(re.compile(rf"^model\.layers\.(\d+)\.{p}$"), m, k, i) for p, m, k, i in _LAYER_NAMES]
_TOP_NAMES = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
              "model.norm.weight": "decoder.final_layernorm.weight",
              "lm_head.weight": "output_layer.weight"}
_MLA_Q = re.compile(r"^model\.layers\.(\d+)\.self_attn\.q_proj\.weight$")
# Megatron's distributed-checkpoint keys for the local layer spec's norms (the fused-layer keys, so a checkpoint
# loads into either spec)
_SHARDED_RENAMES = (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor lives in Megatron: the parameter name `template` with {layer} / {expert}
    placeholders (filled with stage-local / EP-local numbers), the global layer and expert, and how it is fused."""

    template: str
    layer: int | None
    expert: int | None
    kind: str | None  # None (the tensor itself), "glu" ([gate; up]) or "qkv" (interleaved per query group)
    member: int


def target(name: str, arch: Arch) -> Target:
    """Megatron's home of checkpoint tensor `name`; ConfigError when the format does not know it."""
    if name in _TOP_NAMES:
        return Target(_TOP_NAMES[name], None, None, None, 0)
    if arch.mla:
        m = _MLA_Q.match(name)
        if m:
            return Target("decoder.layers.{layer}.self_attention.linear_q_proj.weight", int(m[1]), None, None, 0)
    for rx, meg, kind, member in _LAYER_RES:
        m = rx.match(name)
        if m:
            expert = int(m[2]) if "{e}" in meg else None
            local = meg.replace("{1}", m[2] if "{1}" in meg else "").replace("{e}", "{expert}")
            return Target("decoder.layers.{layer}." + local, int(m[1]), expert, kind, member)
    raise ConfigError(f"the megatron format does not know where Megatron-core keeps checkpoint tensor {name!r}",
                      key="model")


# ------------------------------------------------------------------------------------------ fused views


def _fused_views(kind: str | None, members: list, arch: Arch) -> tuple[tuple, list[View]]:
    """Shape of a Megatron tensor made of `members` [(tensor, box)] (its parts in member order, each the box
    the tensor holds) and the views that fill it. The same function gives a rank's local tensor (its boxes)
    and the global tensor of the distributed checkpoint (full boxes)."""
    if kind is None:
        (t, box), = members
        return box.sizes, [View(t, box, tuple(slice(0, s) for s in box.sizes))]
    rest = members[0][1].sizes[1:]
    tail = tuple(slice(0, s) for s in rest)
    if kind == "glu":
        views, row = [], 0
        for t, box in members:
            views.append(View(t, box, (slice(row, row + box.sizes[0]),) + tail))
            row += box.sizes[0]
        return (row, *rest), views
    # qkv: per query group g: [q rows of g (heads/groups × head_dim); k_g (head_dim); v_g (head_dim)]
    per = [arch.heads // arch.groups * arch.head_dim, arch.head_dim, arch.head_dim]
    stride = sum(per)
    (_, qb), (_, kb), (_, vb) = members
    groups = kb.sizes[0] // arch.head_dim
    first = [b.offsets[0] // p for (_, b), p in zip(members, per)]
    if len(set(first)) != 1 or any(b.sizes[0] != groups * p or b.offsets[0] % p for (_, b), p in zip(members, per)):
        raise ConfigError(f"q/k/v boxes {qb}, {kb}, {vb} are not whole query groups of {per} rows", key="model")
    views = []
    for g in range(groups):
        at = g * stride
        for (t, box), p in zip(members, per):
            sub = Box((box.offsets[0] + g * p, *box.offsets[1:]), (p, *box.sizes[1:]))
            views.append(View(t, sub, (slice(at, at + p),) + tail))
            at += p
    return (groups * stride, *rest), views


def _vocab_rows(layout, t: int) -> int | None:
    """Rows of one rank's padded vocab part (None if tensor `t` is not a padded vocab tensor)."""
    p = layout.placements[t]
    if p.pad <= 1 or not re.search(VOCAB, layout.manifest.tensors[t].name):
        return None
    parts = 1
    for s, size in zip(p.shard, p.mesh.shape):
        if s == 0:
            parts *= size
    return chunk_size(layout.manifest.tensors[t].shape[0], parts, p.pad)


def _group(entries, arch: Arch) -> dict:
    """{(name key): [kind, {member: (t, box)}]} for entries [(t, box, Target, name)]."""
    out: dict = {}
    for t, box, tg, name in entries:
        slot = out.setdefault(name, [tg.kind, {}])
        slot[1][tg.member] = (t, box)
    return out


def storage(layout, rank: int) -> list[EngineTensor]:
    """Megatron's parameters on `rank` (named as `named_parameters()` names them), each with its views."""
    arch = Arch.of(layout.manifest.config or {})
    tensors = layout.manifest.tensors
    first_layer = _stage_starts(layout)
    expert_base = _expert_base(layout, rank)
    entries = []
    for t, box in layout.held(rank):
        tg = target(tensors[t].name, arch)
        layer = None if tg.layer is None else tg.layer - first_layer[layout.stage_of_layer[tg.layer]] \
            if layout.pipeline else tg.layer
        expert = None if tg.expert is None else tg.expert - expert_base(tg.expert)
        entries.append((t, box, tg, tg.template.format(layer=layer, expert=expert)))
    out = []
    for name, (kind, members) in _group(entries, arch).items():
        want = {"glu": 2, "qkv": 3}.get(kind, 1)
        if len(members) != want:
            missing = sorted(set(range(want)) - set(members))
            raise ConfigError(f"rank {rank}: {name} is fused from {want} checkpoint tensors, but this rank holds "
                              f"only {len(members)} (member {missing[0]} has another placement)", key="model")
        parts = [members[i] for i in range(want)]
        shape, views = _fused_views(kind, parts, arch)
        rows = _vocab_rows(layout, parts[0][0]) if kind is None else None
        if rows is not None:
            shape = (rows, *shape[1:])
        out.append(EngineTensor(name, tuple(shape), tensors[parts[0][0]].dtype, tuple(views)))
    return out


def _stage_starts(layout) -> list[int]:
    """First global layer of each pipeline stage."""
    starts, seen = [], -1
    for i, s in enumerate(layout.stage_of_layer):
        if s != seen:
            starts.extend([i] * (s - seen))
            seen = s
    return starts or [0]


def _expert_base(layout, rank: int):
    """Global index of local expert 0 for a given expert (experts are linear over ep: E/ep per rank)."""
    if not layout.experts:
        return lambda e: 0
    n = 1
    for p in layout.placements:
        if p.mesh.name == "expert":
            n = p.mesh.shape[p.mesh.dims.index("ep")]
            break
    per = max(_num_experts(layout) // n, 1)
    return lambda e: (e // per) * per


def _num_experts(layout) -> int:
    return Arch.of(layout.manifest.config or {}).experts or 1


# ------------------------------------------------------------------------------------------ live parameters


# The transformer-engine layer spec (what Megatron runs on GPUs) names some parameters differently from the local
# spec; both hold the same tensor. TE name -> local name:
_TE_NAMES = ((re.compile(r"\.self_attention\.linear_qkv\.layer_norm_weight$"), ".input_layernorm.weight"),
             (re.compile(r"\.mlp\.linear_fc1\.layer_norm_weight$"), ".pre_mlp_layernorm.weight"),
             (re.compile(r"\.self_attention\.linear_q_up_proj\.layer_norm_weight$"),
              ".self_attention.q_layernorm.weight"),
             (re.compile(r"\.self_attention\.linear_kv_up_proj\.layer_norm_weight$"),
              ".self_attention.kv_layernorm.weight"),
             (re.compile(r"\.mlp\.experts\.linear_fc(\d)\.weight(\d+)$"),  # grouped GEMM (TEGroupedMLP)
              r".mlp.experts.local_experts.\2.linear_fc\1.weight"))


def _strip(name: str) -> str:
    """A parameter name as the local spec gives it: wrappers' `module.` prefixes dropped, TE names mapped."""
    while name.startswith("module."):
        name = name[len("module."):]
    for rx, local in _TE_NAMES:
        name = rx.sub(local, name)
    return name


def bind(params: dict, layout, rank: int, casts: list | None = None) -> dict:
    """This rank's checkpoint tensors as views into a live Megatron model's parameters (`named_parameters()`,
    wrappers' `module.` prefixes allowed; the local or the transformer-engine layer spec, grouped-GEMM experts
    `linear_fc1.weightK` included), keyed by checkpoint name: a tensor, or `Fragments` where a box is
    spread over several regions. Every parameter the layout expects must exist with its shape and dtype, and
    every parameter of the model must be covered; otherwise one ConfigError names the tensor and the
    mismatch (heads, groups, vocab padding, expert count and pipeline split all show up here). A parameter
    kept in another floating-point type than the checkpoint's (Megatron keeps norms in fp32) is cast: a copy
    of that tensor only, made at each bind; with `casts` given, (copy, parameter) pairs are appended to it so
    that a caller keeping the binding between refits can refresh the copies (`copy.copy_(parameter)`)."""
    import torch

    from reshard_cli.base.fragments import Fragments

    have = {_strip(n): p for n, p in params.items()}
    names = [t.name for t in layout.manifest.tensors]
    expected = storage(layout, rank)
    parts: dict[int, list] = {}
    for et in expected:
        p = have.get(et.name)
        if p is None:
            raise ConfigError(f"rank {rank}: the Megatron model has no parameter {et.name!r} (the layout puts "
                              f"{names[et.views[0].tensor]} here: {_hint(layout, rank)}; a buffer such as a "
                              f"router's expert_bias is passed with named_buffers())", key="src")
        data = p.data if isinstance(p, torch.nn.Parameter) else p
        want = getattr(torch, et.dtype)
        if tuple(data.shape) == et.shape and data.dtype != want and data.is_floating_point() \
                and want.is_floating_point:
            cast = data.to(want)  # kept in another float type (Megatron's fp32 norms): cast, this tensor only
            if casts is not None:
                casts.append((cast, data))
            data = cast
        if tuple(data.shape) != et.shape or str(data.dtype).removeprefix("torch.") != et.dtype:
            raise ConfigError(f"rank {rank}: Megatron parameter {et.name} is {list(data.shape)} "
                              f"{str(data.dtype).removeprefix('torch.')}, the layout expects {list(et.shape)} "
                              f"{et.dtype} ({_hint(layout, rank)})", key="src")
        for v in et.views:
            parts.setdefault(v.tensor, []).append((v.box, data[v.region]))
    covered = {et.name for et in expected}
    if "lm_head.weight" not in names:  # tied: the last stage's output layer is a copy of the embedding
        covered.add("output_layer.weight")
    extra = [n for n in have if n not in covered and not n.endswith("_extra_state")
             and "position_embeddings" not in n]
    if extra:
        raise ConfigError(f"rank {rank}: Megatron parameter {extra[0]!r} is filled by no checkpoint tensor of the "
                          f"layout ({_hint(layout, rank)})", key="src")
    held = dict(layout.held(rank))
    out = {}
    for t, pieces in parts.items():
        if len(pieces) == 1:
            out[names[t]] = pieces[0][1]
        else:
            out[names[t]] = Fragments(held[t], tuple(pieces))
    return out


def _hint(layout, rank: int) -> str:
    """What the layout assumed, for mismatch messages."""
    arch = Arch.of(layout.manifest.config or {})
    dims = {d: n for m in layout.meshes.values() for d, n in zip(m.dims, m.shape)}
    bits = [f"{d} {n}" for d, n in dims.items() if n > 1 and d in ("tp", "pp", "ep", "etp")]
    bits.append(f"heads {arch.heads}, query groups {arch.groups}, head_dim {arch.head_dim}")
    if arch.experts:
        bits.append(f"{arch.experts} experts")
    if layout.pipeline:
        stage = layout.placements[0].mesh.coord_of(rank)[layout.placements[0].mesh.dims.index(layout.pipeline)] \
            if layout.pipeline in layout.placements[0].mesh.dims else None
        layers = [i for i, s in enumerate(layout.stage_of_layer) if s == stage]
        if layers:
            bits.append(f"stage {stage} holds layers {layers[0]}-{layers[-1]}")
    return ", ".join(bits)


# ------------------------------------------------------------------------------------------ distributed checkpoint


@dataclass(frozen=True)
class CheckpointView:
    """Checkpoint box `box` of a tensor lies in region (offsets) of sharded key `key` (global shape `shape`)."""

    key: str
    shape: tuple
    box: Box
    offsets: tuple  # start of the region in the key's global tensor; leading layer / expert axes add dims


def global_views(manifest, *, per_layer: bool = False) -> dict[int, list[CheckpointView]]:
    """For every checkpoint tensor, where Megatron's distributed checkpoint (`torch_dist`) keeps it.

    Megatron stacks the layers of a homogeneous model under one key with a leading layer axis
    (`decoder.layers.mlp.linear_fc1.weight [L, 2F, H]`); `per_layer` gives the non-homogeneous convention
    (`decoder.layers.N.…`, used with `moe_layer_freq` lists, heterogeneous blocks or
    `non_homogeneous_layers` / `singleton_local_shards` metadata). Experts of a layer are one key with a
    leading expert axis after the layer axis; norms use the fused-layer keys."""
    arch = Arch.of(manifest.config or {})
    entries = []
    for t, spec in enumerate(manifest.tensors):
        tg = target(spec.name, arch)
        name = tg.template.format(layer=tg.layer, expert=0)
        entries.append((t, Box.full(spec.shape), tg, (name, tg.layer, tg.expert)))
    out: dict[int, list[CheckpointView]] = {}
    for (name, layer, expert), (kind, members) in _group(entries, arch).items():
        want = {"glu": 2, "qkv": 3}.get(kind, 1)
        if len(members) != want:
            continue  # a fused tensor with a member missing from the manifest: nothing to read
        shape, views = _fused_views(kind, [members[i] for i in range(want)], arch)
        key = name
        for local, sharded in _SHARDED_RENAMES:
            if key.endswith("." + local):
                key = key[: -len(local)] + sharded
        lead: tuple = ()
        if expert is not None:
            key = re.sub(r"\.local_experts\.\d+\.", ".experts.", key)
            shape, lead = (arch.experts, *shape), (expert,)
        if layer is not None and not per_layer:
            key = key.replace(f"decoder.layers.{layer}.", "decoder.layers.", 1)
            shape, lead = (arch.layers, *shape), (layer, *lead)
        for v in views:
            out.setdefault(v.tensor, []).append(
                CheckpointView(key, tuple(shape), v.box, lead + tuple(r.start for r in v.region)))
    return out


def summary(layout, rank: int | None = None) -> dict:
    """What one source rank's Megatron storage holds: its parameters, their bytes and the checkpoint bytes read
    straight from them (all of them: every checkpoint byte a rank holds has a view)."""
    rank = layout.ranks[0] if rank is None else rank
    tensors = storage(layout, rank)
    s = storage_summary(layout, tensors, rank)
    return {"format": "megatron", "rank": rank, "megatron_tensors": len(tensors), "megatron_bytes": s["total_bytes"],
            "direct_bytes": s["direct_bytes"], "padding_bytes": s["padding_bytes"],
            "fused_tensors": sum(len({v.tensor for v in et.views}) > 1 for et in tensors)}


# ------------------------------------------------------------------------------------------ a running model


def live_layout_doc(model, hf_model, *, rank: int | None = None, file: str = "<megatron model>") -> dict:
    """The source layout document (YAML-ready) of a running Megatron-core model, read from
    `megatron.core.parallel_state` and the model itself (layers per stage, padded vocabulary); `hf_model` is
    the checkpoint it corresponds to (a config.json, a safetensors directory or a bundled name) and names the
    tensors. Collective over Megatron's world. `rank` is this process's rank in the refit (default: its
    Megatron world rank).

    Every rank checks its coordinates in the derived meshes against parallel_state's; `bind` (called by
    `Refit`) then checks every parameter against the layout, so a mismatch fails before any byte moves."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    hf_model = Path(hf_model).resolve() if Path(hf_model).exists() else hf_model  # any process can read it
    chunks = model if isinstance(model, (list, tuple)) else [model]
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if len(chunks) != 1 or vpp > 1:
        raise ConfigError("virtual pipeline stages are not supported: pass one model chunk", key="model")
    params = {_strip(n): p for n, p in chunks[0].named_parameters()}
    layers = len({m[1] for n in params for m in [re.match(r"decoder\.layers\.(\d+)\.", n)] if m})
    emb = params.get("embedding.word_embeddings.weight")
    out = params.get("output_layer.weight")
    rows = emb.shape[0] if emb is not None else out.shape[0] if out is not None else None
    sizes = {"pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
             "cp": ps.get_context_parallel_world_size(), "tp": ps.get_tensor_model_parallel_world_size()}
    mine = {"rank": dist.get_rank() if rank is None else rank,
            "dense": (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
                      ps.get_context_parallel_rank(), ps.get_tensor_model_parallel_rank()),
            "expert": (ps.get_pipeline_model_parallel_rank(), ps.get_expert_data_parallel_rank(),
                       ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()),
            "ep": ps.get_expert_model_parallel_world_size(), "etp": ps.get_expert_tensor_parallel_world_size(),
            "layers": layers, "vocab_rows": rows}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_coord = {e["dense"]: e for e in everyone}
    if len(by_coord) != len(everyone):
        raise ConfigError("two Megatron ranks report the same (pp, dp, cp, tp) coordinate", key="parallel_state")
    order = sorted(by_coord)  # row-major over (pp, dp, cp, tp): the layout's rank order
    stage_layers = [next(e["layers"] for e in everyone if e["dense"][0] == s) for s in range(sizes["pp"])]
    vocab_rows = next((e["vocab_rows"] for e in everyone if e["vocab_rows"] is not None), None)
    dims = {d: n for d, n in sizes.items() if n > 1} or {"tp": 1}
    megatron = {"expert_model_parallel_size": mine["ep"], "pipeline_layers": stage_layers}
    if vocab_rows is not None:
        megatron["padded_vocab_size"] = vocab_rows * sizes["tp"]
    doc = {"model": str(hf_model), "format": "megatron", "ranks": [by_coord[c]["rank"] for c in order],
           "mesh": dims, "megatron": megatron}
    if mine["etp"] != sizes["tp"]:
        megatron["expert_tensor_parallel_size"] = mine["etp"]
    if sizes["pp"] == 1:
        del megatron["pipeline_layers"]
    _check_coordinates(layout_from_doc(doc, file=file, format="megatron", expand=expand,
                                       format_keys=tuple(FORMAT.keys)), everyone)
    return doc


def _check_coordinates(layout, everyone: list[dict]) -> None:
    """The derived meshes must put every rank where Megatron's parallel_state does."""
    for e in everyone:
        for mesh_name, got in (("dense", e["dense"]), ("expert", e["expert"])):
            mesh = layout.meshes.get(mesh_name)
            if mesh is None:
                continue
            names = ("pp", "dp", "cp", "tp") if mesh_name == "dense" else ("pp", "edp", "ep", "etp")
            want = dict(zip(mesh.dims, mesh.coord_of(e["rank"])))
            have = {d: c for d, c in zip(names, got) if d in mesh.dims}
            if want != have:
                raise ConfigError(f"rank {e['rank']}: parallel_state puts it at {mesh_name} {have}, the default "
                                  f"Megatron rank order (tp-cp-ep-dp-pp) at {want}", key="parallel_state")


FORMAT = Format(name="megatron", description="Megatron-core's parameters, placed by its own parallel arguments",
                keys={"megatron": "holds Megatron's parallel arguments"}, expand=expand, storage=storage, bind=bind, summary=summary,
                live_layout_doc=live_layout_doc)
