"""vLLM's storage of a checkpoint learned from vLLM itself: its model classes and `load_weights`, watched.

`formats.vllm.storage` restates by hand, per architecture, which box of each checkpoint tensor lands where in
each engine parameter of one rank. Here vLLM says it: the model class of an HF config is built in this process
on CPU (no engine, no process group: vLLM's parallel groups are stand-ins that answer rank and size only),
sentinel-filled, and loaded by its own `load_weights` from a checkpoint whose every element is its own address:
tensor k's element i holds the float32 integer `start[k] + i + 1` (exact below 2**24). Reading each parameter
back names, per element, the checkpoint element it holds; elements with one translation between the two
index spaces form a box of the checkpoint and a region of the parameter (a `Copy`). What is left:

- NaN (the sentinel): nothing wrote it (vLLM's padding, or a parameter no checkpoint tensor reaches);
- 0.0: the loader cleared it (the padded vocab rows vLLM zeroes);
- anything else: a transformed load (Mamba's A = -exp(A_log), a dtype vLLM keeps apart). The checkpoint
  tensor that wrote it is known because the feed is watched: before the loader gets tensor k+1, every
  parameter is compared with its state before tensor k (a loader that buffers tensors shows up as a later
  writer). Each such tensor is then fed once more with values 1 + (i + 0.5)/n, and a few elementwise
  functions are tried backwards (`TRANSFORMS`), which names the function and, again, the boxes.

`process_weights_after_loading` never runs: this is the storage a refit writes, not a kernel's repacking.
The checkpoint's names come from transformers (`layouts.hf_meta`: the HF class of the config built on the
meta device, named as `save_pretrained` writes it), or from the caller (a reshard manifest). Reported dtypes are those of a second build in the requested dtype, on the meta
device where the class allows it (the derivation itself runs in float32).

    d = derive(config, tp_size=2, tp_rank=1)
    d.params["model.layers.0.self_attn.qkv_proj.weight"].copies   # (Copy(source, offsets, sizes, region), ...)
    compare(d, layout, rank)                                       # [] when formats.vllm.storage agrees
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reshard_cli.base.geometry import Box
from reshard_cli.engines.vllm import compat
from reshard_cli.errors import ConfigError
from reshard_cli.formats import FORMATS
from reshard_cli.formats import derived as derived_map
from reshard_cli.formats.storage import EngineTensor, View
from reshard_cli.formats.vllm import storage
from reshard_cli.layouts.hf_meta import tensors_from_transformers

EXACT = 1 << 24  # float32 holds every integer up to here
TRANSFORMS = {  # name: (function, its inverse), tried on the values a transformed load wrote
    "-exp": (lambda x: -torch.exp(x), lambda y: torch.log(-y)),
    "exp": (torch.exp, torch.log),
    "neg": (torch.neg, torch.neg),
    "identity (inexact dtype)": (lambda x: x, lambda y: y),
}


@dataclass(frozen=True)
class Copy:
    """Checkpoint tensor `source`'s box (`offsets`, `sizes`) lands in `region` of the parameter: ints for the
    parameter's leading dims the checkpoint tensor lacks (a stacked expert), slices for the others; the
    region's elements in row-major order are the box's. `transform` names the function of a transformed
    load (`TRANSFORMS`, or a permutation of the box: `formats.derived.apply_transform`), None for a
    bit-for-bit copy."""

    source: str
    offsets: tuple
    sizes: tuple
    region: tuple
    transform: str | None = None


@dataclass(frozen=True)
class Param:
    """One parameter (or written buffer) of the rank's model by its vLLM name: shape, dtype in the requested
    model dtype, its copies, and the elements no copy explains: `transformed` (written, value not a
    checkpoint element's: {source: count}, None as source where no function of `TRANSFORMS` explained
    them), `zeroed` (written 0.0), `unwritten` (kept the sentinel)."""

    name: str
    shape: tuple
    dtype: str
    copies: tuple
    transformed: dict = field(default_factory=dict)
    zeroed: int = 0
    unwritten: int = 0


@dataclass(frozen=True)
class Derived:
    """What vLLM's loader did with one checkpoint on one rank. `transformed`: the transformed loads as
    (source, parameter, transform or None, elements); `unplaced`: checkpoint tensors no element of which
    reached any parameter (skipped by `load_weights`, or written nowhere); `checkpoint`: name -> shape fed."""

    config: dict
    tp_size: int
    tp_rank: int
    params: dict  # name -> Param, in named_parameters() order
    transformed: tuple
    unplaced: tuple
    checkpoint: dict
    seconds: float
    expert_parallel: bool = False  # vLLM's options the rank was built with
    expert_placement: str = "linear"
    dp_size: int = 1  # the data-parallel replicas expert parallelism spans, and this rank's
    dp_rank: int = 0
    pp_size: int = 1  # pipeline stages, and this rank's
    pp_rank: int = 0
    all2all: str = derived_map.ALL2ALL_DEFAULT  # vLLM's MoE all2all backend (sequence-parallel MoE or not)


def hf_checkpoint(config: dict) -> dict[str, tuple]:
    """Name -> shape of the checkpoint transformers would save for `config` (`layouts.hf_meta`: its model on
    the meta device, named and typed as `save_pretrained` writes it)."""
    return {name: tuple(shape) for name, shape, _dtype in tensors_from_transformers(config, "config")}


class _Group:
    """A vLLM `GroupCoordinator` stand-in: what model construction and the loaders read of a group (its size,
    this rank's place in it, first or last, a process group that answers `size()` and `rank()`), no
    communication. Any other attribute fails naming itself, so a loader that would communicate says so."""

    def __init__(self, size: int, rank: int):
        self.world_size, self.rank_in_group, self.rank, self.local_rank = size, rank, rank, 0
        self.ranks, self.group_ranks, self.unique_name = list(range(size)), [list(range(size))], "reshard-derive"
        self.device, self.device_communicator, self.use_device_communicator = torch.device("cpu"), None, False
        self.device_group = self.cpu_group = type("PG", (), {"size": lambda s: size, "rank": lambda s: rank})()
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.first_rank, self.last_rank = 0, size - 1

    def __getattr__(self, name: str):
        raise AttributeError(f"derive: vLLM used {name!r} of a parallel group, which a derivation does not run")


@contextlib.contextmanager
def _vllm(config: dict, tp_size: int, tp_rank: int, expert_parallel: bool, expert_placement: str,
          dp_size: int = 1, dp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0,
          all2all: str = derived_map.ALL2ALL_DEFAULT):
    """vLLM's parallel groups replaced by `_Group`s (TP: this rank; DP: this replica of `dp_size`, which only
    expert parallelism spans; EP: the dp x tp ranks when `expert_parallel`, rank dp_rank * tp_size + tp_rank
    as vLLM flattens them; PP: this rank's stage of `pp_size`; the others of one) while open, for `config`
    written where vLLM reads it. Yields a function building the model in a dtype on a device
    (`compat.build_model`, under MoE all2all backend `all2all`)."""
    with tempfile.TemporaryDirectory(prefix="reshard-derive-") as tmp:
        Path(tmp, "config.json").write_text(json.dumps(config))
        ep = (dp_size * tp_size, dp_rank * tp_size + tp_rank) if expert_parallel else (1, 0)
        groups = {"_TP": (tp_size, tp_rank), "_WORLD": (tp_size, tp_rank), "_EP": ep, "_PP": (pp_size, pp_rank),
                  "_DP": (dp_size, dp_rank), "_PCP": (1, 0), "_DCP": (1, 0)}
        with compat.standin_groups({name: _Group(size, rank) for name, (size, rank) in groups.items()}):
            yield lambda dtype, device: compat.build_model(tmp, tp_size=tp_size, expert_parallel=expert_parallel,
                                                           expert_placement=expert_placement, dtype=dtype,
                                                           device=device, dp_size=dp_size, dp_rank=dp_rank,
                                                           pp_size=pp_size, all2all=all2all)


def _tensors(model) -> dict[str, torch.Tensor]:
    """Parameters (under the names `load_weights` uses) and buffers, floating point only; not a buffer over
    a parameter's storage (Mamba's `conv_weights` is its `conv1d.weight` as [C, K])."""
    out = {n: p.data for n, p in model.named_parameters()}
    held = {t.untyped_storage().data_ptr() for t in out.values() if t.device.type != "meta"}
    for n, b in model.named_buffers():
        if b.device.type == "meta" or b.untyped_storage().data_ptr() not in held:
            out.setdefault(n, b)
    return {n: t for n, t in out.items() if t.is_floating_point()}


def _load(vc, model, items: list, tensors: dict) -> dict[str, torch.Tensor]:
    """`model.load_weights(items)` under its config, watched: name -> int32 tensor of the index in `items`
    of the checkpoint tensor whose turn it was when each element last changed (-1: never; len(items): after
    the last one, a loader that buffers)."""
    prev = {n: t.clone() for n, t in tensors.items()}
    writer = {n: torch.full(t.shape, -1, dtype=torch.int32) for n, t in tensors.items()}
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}

    def settle(k: int) -> None:
        for n, t in tensors.items():
            changed = t.view(bits[t.element_size()]) != prev[n].view(bits[t.element_size()])  # NaN == NaN
            if changed.any():
                writer[n][changed] = k
                prev[n].copy_(t)

    def feed():
        for k, item in enumerate(items):
            yield item
            settle(k)  # the loader asks for the next tensor: it is done with this one

    compat.load_under(vc, model, feed())
    settle(len(items))
    return writer


def _boxes(eng: torch.Tensor, src: torch.Tensor) -> list[tuple]:
    """Split engine positions `eng` [n, d] (one translation to checkpoint positions `src`) into boxes:
    [(lo, hi, src_lo)], one when the positions fill their bounding box, else split along the first dim
    that varies and rejoined where consecutive slices match."""
    lo, hi = eng.min(0).values, eng.max(0).values + 1
    if math.prod((hi - lo).tolist()) == len(eng):
        return [(lo.tolist(), hi.tolist(), src.min(0).values.tolist())]
    d = int(((hi - lo) > 1).nonzero()[0])
    out: list[tuple] = []
    for v in eng[:, d].unique().tolist():
        for b in _boxes(eng[eng[:, d] == v], src[eng[:, d] == v]):
            j = next((i for i, o in enumerate(out) if o[1][d] == b[0][d] and o[0][:d] + o[0][d + 1:] == b[0][:d]
                      + b[0][d + 1:] and o[1][:d] + o[1][d + 1:] == b[1][:d] + b[1][d + 1:]), None)
            if j is None:
                out.append(b)
            else:
                out[j] = (out[j][0], b[1], out[j][2])
    return out


def _copies(eng: torch.Tensor, eshape: tuple, src_flat: torch.Tensor, name: str, sshape: tuple,
            transform: str | None = None) -> list[Copy]:
    """The copies of checkpoint tensor `name` (shape `sshape`) at positions `eng` [n, d] of a parameter of
    shape `eshape`, from its flat indices `src_flat`. Dims of extent 1 on either side are set aside (an HF
    conv1d [C, 1, K] is vLLM's [C, K]), the others paired from the last (or, where the loader transposes,
    in the order that gives fewer groups: `_pairing`); positions are grouped by their translation (and by the
    coordinates of the leading dims only one side has), each group cut into boxes."""
    src = torch.stack(torch.unravel_index(src_flat, sshape), 1) if sshape else src_flat[:, None] * 0
    ek, sk = [i for i, n in enumerate(eshape) if n != 1], [i for i, n in enumerate(sshape) if n != 1]
    er, sr = len(ek), len(sk)
    r = min(er, sr)
    e = eng[:, ek]
    paired, group = _pairing(e, src, ek, sk, r)
    s = src[:, sk[:sr - r] + paired]
    if paired != sorted(paired):  # (dims of extent 1 move freely)
        order = paired + [d for d in range(len(sshape)) if d not in paired]
        transform = "; ".join(x for x in (transform, derived_map.permute_name(tuple(order))) if x)
    out = []
    for g in group.unique().tolist():
        sel = group == g
        for lo, hi, s_lo in _boxes(e[sel], s[sel]):
            region = [0] * len(eshape)
            for j, i in enumerate(ek):
                region[i] = lo[j] if j < er - r else slice(lo[j], hi[j])
            offsets, sizes = [0] * len(sshape), [1] * len(sshape)
            for j, i in enumerate(sk[:sr - r] + paired):
                offsets[i] = s_lo[j]
                if j >= sr - r:
                    sizes[i] = hi[j - sr + er] - lo[j - sr + er]
            out.append(Copy(name, tuple(offsets), tuple(sizes), tuple(region), transform))
    return out


def _pairing(e: torch.Tensor, src: torch.Tensor, ek: list, sk: list, r: int) -> tuple:
    """The source dims paired with the parameter's last `r` dims (of extent over 1), and each position's group
    (one translation): from the last dims, unless another order of the source's last `r` dims gives fewer
    groups (a loader that transposes: gpt-oss's experts)."""
    best = None
    for perm in itertools.permutations(sk[len(sk) - r:]) if r <= 3 else [tuple(sk[len(sk) - r:])]:
        s = src[:, sk[:len(sk) - r] + list(perm)]
        er, sr = e.shape[1], s.shape[1]
        key = torch.zeros(len(e), dtype=torch.int64)
        for col in torch.cat([s[:, sr - r:] - e[:, er - r:], s[:, :sr - r], e[:, :er - r]], 1).T:
            key = key * (int(col.max() - col.min()) + 1) + (col - col.min())  # one int per key: a 1-D unique
        _, group = torch.unique(key, return_inverse=True)
        n = int(group.max()) + 1 if len(group) else 0
        if best is None or n < best[0]:
            best = (n, list(perm), group)
    return best[1], best[2]


def _permuted(params: dict) -> list[tuple]:
    """The loads that only transpose (`_pairing`), in `Derived.transformed`'s terms, as the trace counts them."""
    out = []
    for n, p in params.items():
        moved: dict = {}
        for c in p.copies:
            if c.transform and c.transform.startswith(derived_map.PERMUTE):
                moved[(c.source, c.transform)] = moved.get((c.source, c.transform), 0) + math.prod(c.sizes)
        out += [(s, n, f, k) for (s, f), k in moved.items()]
    return out


def _positions(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    flat = mask.reshape(-1).nonzero().squeeze(1)
    return torch.stack(torch.unravel_index(flat, t.shape), 1) if t.dim() else flat[:, None] * 0


def _built(config: dict, build, dtype: str, device: str):
    """`build(dtype, device)`, or one ConfigError naming the architecture and vLLM's reason when this vLLM
    cannot construct it here (a kernel its CPU build lacks, an import it cannot satisfy, a config key its
    model reads). NotImplementedError on the meta device passes (the caller builds on CPU instead)."""
    try:
        return build(dtype, device)
    except NotImplementedError as e:
        if device == "meta":
            raise
        why = e
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        why = e
    arch = ", ".join(config.get("architectures") or [str(config.get("model_type"))])
    reason = " ".join(str(why).split())[:300]
    raise ConfigError(f"vLLM {compat.version()} cannot build {arch} in this process: {type(why).__name__}: "
                      f"{reason}", key="config") from why


def derive(config: dict, *, tp_size: int = 1, tp_rank: int = 0, dtype: str = "bfloat16",
           expert_parallel: bool = False, expert_placement: str = "linear", checkpoint: dict | None = None,
           dp_size: int = 1, dp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0,
           all2all: str = derived_map.ALL2ALL_DEFAULT) -> Derived:
    """What vLLM's `load_weights` writes where on TP rank `tp_rank` of `tp_size` for an HF `config` (a
    config.json dict, small enough that the checkpoint has under 2**24 elements: a scaled-down model), from
    `checkpoint` (name -> shape; default `hf_checkpoint(config)`). The rest are vLLM's options: its replicas
    (experts spread over them), stages (a rank builds its layers only), `--all2all-backend`."""
    t0 = time.perf_counter()
    spec = dict(checkpoint) if checkpoint is not None else hf_checkpoint(config)
    names, shapes = list(spec), [tuple(s) for s in spec.values()]
    sizes = torch.tensor([math.prod(s) for s in shapes], dtype=torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    if total >= EXACT:
        raise ConfigError(f"the checkpoint has {total} elements; a derivation addresses each in float32, so it "
                          f"needs fewer than {EXACT}: scale the config down", key="config")
    items = [(n, (torch.arange(int(sizes[k]), dtype=torch.float32) + float(starts[k] + 1)).reshape(shapes[k]))
             for k, n in enumerate(names)]
    with _vllm(config, tp_size, tp_rank, expert_parallel, expert_placement, dp_size, dp_rank, pp_size,
               pp_rank, all2all) as build:
        try:
            typed, _ = _built(config, build, dtype, "meta")
        except NotImplementedError:  # a data-dependent op at construction: build it for real
            typed, _ = _built(config, build, dtype, "cpu")
        dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in _tensors(typed).items()}
        del typed
        model, vc = _built(config, build, "float32", "cpu")
        tensors = {n: t for n, t in _tensors(model).items() if t.device.type != "meta"}  # (a rotary cache vLLM
        # memoised in the meta build above: computed, never loaded)
        for t in tensors.values():
            t.fill_(float("nan"))
        writer = _load(vc, model, items, tensors)
        params, odd, placed = {}, {}, set()
        buffers = {n for n, _ in model.named_buffers()}
        for n, t in tensors.items():
            v, w = t.float(), writer[n]
            if n in buffers and not (w >= 0).any():
                continue  # a buffer vLLM computes (rotary caches, KV-cache scales), not loaded
            code = (v - 1).reshape(-1)
            is_code = (torch.isfinite(code) & (code == code.round()) & (code >= 0) & (code < total)).reshape(v.shape)
            copies = []
            pos, codes = _positions(v, is_code), code[is_code.reshape(-1)].long()
            tid = torch.searchsorted(starts, codes, right=True) - 1
            for k in tid.unique().tolist():
                sel = tid == k
                copies += _copies(pos[sel], tuple(t.shape), codes[sel] - starts[k], names[k], shapes[k])
                placed.add(names[k])
            odd[n] = other = ~is_code & ~v.isnan() & (v != 0)
            transformed = {names[k] if 0 <= k < len(names) else None: int((w[other] == k).sum())
                           for k in w[other].unique().tolist()}
            copies.sort(key=lambda c: _norm(c.region, tuple(t.shape)))
            params[n] = Param(n, tuple(t.shape), dtypes.get(n, str(t.dtype).removeprefix("torch.")), tuple(copies),
                              transformed, int(((v == 0) & ~is_code).sum()), int(v.isnan().sum()))
        done = _probe(vc, model, items, tensors, writer, odd, params, names, shapes) + _permuted(params)
    placed |= {c.source for p in params.values() for c in p.copies}
    placed |= {s for p in params.values() for s in p.transformed if s}
    return Derived(dict(config), tp_size, tp_rank, params, tuple(done),
                   tuple(n for n in names if n not in placed), dict(zip(names, shapes)), time.perf_counter() - t0,
                   expert_parallel, expert_placement, dp_size, dp_rank, pp_size, pp_rank, all2all)


def _probe(vc, model, items, tensors, writer, odd, params, names, shapes) -> list[tuple]:
    """The transformed loads: each checkpoint tensor that wrote values no copy explains is fed again with
    1 + (i + 0.5)/n; where one function of `TRANSFORMS` maps those values back onto the grid, its copies
    (labelled with the function) join the parameter's. Returns (source, parameter, function or None, count)."""
    sources = sorted({k for n, m in odd.items() if m.any() for k in writer[n][m].unique().tolist()
                      if 0 <= k < len(names)})
    if not sources:
        return []
    probe = [(names[k], 1 + (torch.arange(math.prod(shapes[k]), dtype=torch.float32) + 0.5).reshape(shapes[k])
              / math.prod(shapes[k])) for k in sources]
    for t in tensors.values():
        t.fill_(float("nan"))
    _load(vc, model, probe, tensors)
    out = []
    for n, m in odd.items():
        for k in (writer[n][m].unique().tolist() if m.any() else []):
            if not 0 <= k < len(names):
                out.append((None, n, None, int((writer[n][m] == k).sum())))
                continue
            mask = m & (writer[n] == k)
            y, size = tensors[n][mask].float(), math.prod(shapes[k])
            for fn, (f, inv) in TRANSFORMS.items():
                with torch.no_grad():
                    idx = ((inv(y) - 1) * size - 0.5).round()
                ok = torch.isfinite(idx) & (idx >= 0) & (idx < size)
                if not ok.all():
                    continue
                idx = idx.long()
                if torch.allclose(f(1 + (idx.float() + 0.5) / size), y, rtol=1e-5, atol=0):
                    p = params[n]
                    extra = _copies(_positions(tensors[n], mask), p.shape, idx, names[k], shapes[k], fn)
                    params[n] = Param(p.name, p.shape, p.dtype, p.copies + tuple(extra),
                                      {s: c for s, c in p.transformed.items() if s != names[k]}, p.zeroed, p.unwritten)
                    out.append((names[k], n, fn, int(mask.sum())))
                    break
            else:
                out.append((names[k], n, None, int(mask.sum())))
    return out


# ------------------------------------------------------------------------------ the map, judged by vLLM's load


def replay(derived: Derived, checkpoint: dict) -> dict[str, torch.Tensor]:
    """What the derived map says each parameter holds after a load of `checkpoint` (name -> float32 tensor of
    the shape `derived.checkpoint` lists): every copy's box written into its region, transformed copies through
    their function; NaN where no copy writes."""
    out = {}
    for p in derived.params.values():
        t = torch.full(p.shape, float("nan"))
        for c in p.copies:
            box = checkpoint[c.source][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))]
            region = t[c.region]  # its elements in row-major order are the box's (through the transform)
            t[c.region] = derived_map.apply_transform(c.transform, box, region.shape) if c.transform \
                else box.reshape(region.shape)
        out[p.name] = t
    return out


def vllm_load(derived: Derived, checkpoint: dict) -> dict[str, torch.Tensor]:
    """The same rank's model (float32, NaN-filled) after vLLM's own `load_weights` of `checkpoint`: its
    parameters by name (those the derivation lists)."""
    with _vllm(derived.config, derived.tp_size, derived.tp_rank, derived.expert_parallel,
               derived.expert_placement, derived.dp_size, derived.dp_rank, derived.pp_size,
               derived.pp_rank, derived.all2all) as build:
        model, vc = _built(derived.config, build, "float32", "cpu")
        tensors = _tensors(model)
        for t in tensors.values():
            t.fill_(float("nan"))
        compat.load_under(vc, model, iter(list(checkpoint.items())))
    return {n: tensors[n] for n in derived.params}


def check_against_load(derived: Derived, seed: int = 0) -> list[str]:
    """The derived map judged by vLLM's own loader: a checkpoint of random values (`seed`) loaded by vLLM
    (`vllm_load`) and replayed through the map (`replay`) must agree on every element of every parameter, bit
    for bit, but where vLLM zeroed what no copy writes (as many as the derivation counted). One line per
    parameter that differs; [] when the map is vLLM's load."""
    g = torch.Generator().manual_seed(seed)
    checkpoint = {n: torch.randn(s, generator=g) for n, s in derived.checkpoint.items()}
    ours, theirs = replay(derived, checkpoint), vllm_load(derived, checkpoint)
    lines = []
    for n, p in derived.params.items():
        a, b = ours[n], theirs[n]
        zeroed = a.isnan() & (b == 0)
        same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan()) | zeroed
        if not bool(same.all()):
            lines.append(f"{n}: {int((~same).sum())} of {a.numel()} elements differ from vLLM's load")
        elif int(zeroed.sum()) != p.zeroed:
            lines.append(f"{n}: vLLM zeroed {int(zeroed.sum())} elements, the derivation counted {p.zeroed}")
    return lines


# ------------------------------------------------------------------------------ in formats.vllm's terms


def _norm(region: tuple, shape: tuple) -> tuple:
    """A region as (start, stop) per dim: an int i is (i, i + 1), a slice is clipped to the dim."""
    return tuple((r, r + 1) if isinstance(r, int) else r.indices(s)[:2] for r, s in zip(region, shape))


def as_engine_tensors(derived: Derived, layout) -> list[EngineTensor]:
    """The derived bit-for-bit copies as `formats.storage.EngineTensor`s of `layout`'s manifest (a checkpoint
    tensor the manifest lacks is a ConfigError); parameters nothing was copied into are left out."""
    out = []
    for p in derived.params.values():
        views = []
        for c in p.copies:
            if c.transform is None:
                if layout.manifest.get(c.source) is None:
                    raise ConfigError(f"{p.name}: vLLM loaded {c.source!r}, which {layout.manifest.name} lacks")
                views.append(View(layout.manifest.index(c.source), Box(c.offsets, c.sizes), c.region))
        if views:
            out.append(EngineTensor(p.name, p.shape, p.dtype, tuple(views)))
    return out


def compare(derived: Derived, layout, rank: int) -> list[str]:
    """Differences, one line each, between the derived storage and `formats.vllm.storage(layout, rank)`:
    parameters only one side has, shapes, dtypes, and views (as sets of (tensor, box, region), regions
    normalized by `_norm`); also every transformed load, unwritten element and unplaced checkpoint tensor
    the layout holds on `rank`, none of which the hand rules describe. [] when both agree."""
    tensors = layout.manifest.tensors
    hand = {et.name: et for et in storage(layout, rank)}
    ours = {et.name: et for et in as_engine_tensors(derived, layout)}

    def views(et):
        return {(tensors[v.tensor].name, tuple(v.box.offsets), tuple(v.box.sizes), _norm(v.region, et.shape))
                for v in et.views}
    lines = [f"{n}: only in vLLM's derivation" for n in ours if n not in hand]
    lines += [f"{n}: only in formats.vllm" for n in hand if n not in ours]
    for n in (n for n in hand if n in ours):
        a, b = hand[n], ours[n]
        if a.shape != b.shape or a.dtype != b.dtype:
            lines.append(f"{n}: formats.vllm {list(a.shape)} {a.dtype}, vLLM {list(b.shape)} {b.dtype}")
        va, vb = views(a), views(b)
        lines += [f"{n}: view only in formats.vllm: {v}" for v in sorted(va - vb)]
        lines += [f"{n}: view only in vLLM: {v}" for v in sorted(vb - va)]
    held = {tensors[t].name for t, _ in layout.held(rank)}
    lines += [f"{p}: {c} elements from {s} transformed by {f or 'an unknown function'}"
              for s, p, f, c in derived.transformed]
    pad = ("embed_tokens.weight", "lm_head.weight")
    lines += [f"{p.name}: {p.unwritten} elements nothing wrote" for p in derived.params.values()
              if p.unwritten and not (p.name.endswith(pad) and p.name in hand)]
    lines += [f"{n}: held on rank {rank} but vLLM placed none of it" for n in derived.unplaced if n in held]
    return lines


def storage_against_load(layout, rank: int, seed: int = 0) -> list[str]:
    """`formats.vllm`'s storage of a `format: vllm` layout (hand rules or a derived map) judged by vLLM's own
    loader on one rank: the rank's model (in the checkpoint dtype, NaN-filled) built twice in this process,
    once loaded by vLLM's `load_weights` from a random checkpoint, once written as a refit writes it (the boxes
    the layout puts on the rank copied into what `bind` hands out, the staged ones applied); every element of
    every parameter and buffer must agree, bit for bit (but where vLLM zeroed what no box fills). One line per
    tensor that differs; [] when the storage is vLLM's load. Ranks count from the layout's first."""
    tp, dp, pp = derived_map.sizes(layout)
    dp_rank, pp_rank, tp_rank = derived_map.map_coord(layout, rank)
    g = torch.Generator().manual_seed(seed)
    specs = layout.manifest.tensors
    checkpoint = {t.name: torch.randn(t.shape, generator=g).to(getattr(torch, t.dtype)) for t in specs}
    config = layout.manifest.config
    placement = "round_robin" if layout.expert_order == "round_robin" else "linear"
    ours, theirs = {}, {}
    for out in (ours, theirs):
        with _vllm(config, tp, tp_rank, bool(layout.experts), placement, dp, dp_rank, pp, pp_rank,
                   derived_map.all2all_of(layout.engine.get("all2all_backend"), dp)) as build:
            model, vc = _built(config, build, layout.manifest.config.get("torch_dtype") or "bfloat16", "cpu")
            tensors = {n: t for n, t in _tensors(model).items() if t.device.type != "meta"}
            for t in tensors.values():
                t.fill_(float("nan"))
            if out is theirs:
                compat.load_under(vc, model, iter(list(checkpoint.items())))
            else:
                staged: list = []
                buffers = FORMATS["vllm"].bind(dict(model.named_parameters()), layout, rank, staged=staged)
                for t, box in layout.held(rank):
                    buffers[specs[t].name].copy_(checkpoint[specs[t].name][box.slices()])
                for st in staged:
                    st.apply()
            out.update(tensors)
    lines = [f"{n}: only in vLLM's load" for n in theirs if n not in ours]
    for n, a in ours.items():
        b = theirs.get(n)
        if b is None:
            continue
        same = (a.reshape(-1).view(torch.uint8) == b.reshape(-1).view(torch.uint8)).view(-1, a.element_size()).all(1)
        same = same.reshape(a.shape) | (a.isnan() & (b == 0)) | (a.isnan() & b.isnan())
        if not bool(same.all()):
            lines.append(f"{n}: {int((~same).sum())} of {a.numel()} elements differ from vLLM's load")
    return lines
