"""vLLM's storage of a checkpoint learned at full size, without data: its `load_weights` traced on the meta device.

`derive.derive` reads back a model loaded from a checkpoint whose elements are their own addresses, which
holds only below 2**24 elements. Here the same model class is built on the meta device (no memory), fed meta
tensors of the checkpoint's shapes, and the load is watched by a `TorchDispatchMode`: every tensor's elements
are followed through their storage. A view of a checkpoint tensor is that tensor's strided map (its
storage_offset, sizes, strides); elementwise functions (exp, neg, a dtype cast) keep the map and add
themselves to its chain; any other op makes a tensor known only by the checkpoint tensors it came from. A
write into a view of a parameter (`copy_`, `fill_`, another in-place op) is recorded as a strided region of
the parameter with its source; at the end the records are cut into boxes (later writes win), grouped as
`derive` groups elements (one translation per group, dims of extent 1 set aside, the others aligned from the
last) and merged, which gives the same `Copy`s. Elements no write reached are `unwritten`; checkpoint tensors
no write read are `unplaced`.

    d = derive_meta(config, tp_size=8, tp_rank=3)     # a derive.Derived, at any size
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reshard_cli.engines.vllm import compat
from reshard_cli.engines.vllm.derive import Copy, Derived, Param, _built, _norm, _tensors, _vllm, hf_checkpoint
from reshard_cli.errors import ConfigError
from reshard_cli.formats import derived
from reshard_cli.formats.derived import ALL2ALL_DEFAULT

ELEMENTWISE = {"exp", "neg", "_to_copy", "clone", "alias", "detach", "contiguous", "lift_fresh"}
KEEP = {"_to_copy", "clone", "alias", "detach", "contiguous", "lift_fresh"}  # no function of the values
FUNCTIONS = {(): None, ("exp",): "exp", ("neg",): "neg", ("exp", "neg"): "-exp"}  # derive.TRANSFORMS' names
MAX_GROUPS = 1 << 20  # boxes one write may be cut into before it is refused


class NotABox(ConfigError):
    """A write whose region (or source) is not a union of boxes this trace can name."""


class NotOnMeta(ConfigError):
    """A model vLLM cannot build on the meta device (a data-dependent op at construction; EP's expert maps, the
    one known, are built on the CPU meanwhile: `compat.expert_maps_on_cpu`)."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class Map:
    """Elements of a tensor of shape `sizes` as checkpoint tensor `source`'s flat elements `offset + v . strides`,
    through the elementwise functions `chain` (innermost first)."""

    source: str
    offset: int
    sizes: tuple
    strides: tuple
    chain: tuple = ()


@dataclass(frozen=True)
class Mixed:
    """Elements computed from the checkpoint tensors `sources` by something other than a view or an elementwise
    function (or from nothing the trace knows, `sources` empty)."""

    sources: tuple


@dataclass(frozen=True)
class Write:
    """One write into parameter `param`: its elements `offset + v . strides` (v over `sizes`) get `what` (a `Map`,
    a `Mixed`, or a float: a fill) while checkpoint tensor `turn` was being loaded."""

    param: str
    offset: int
    sizes: tuple
    strides: tuple
    what: object
    turn: str | None


def _geometry(t: torch.Tensor) -> tuple:
    return t.storage_offset(), tuple(t.shape), tuple(t.stride())


def _row_major(sizes: tuple) -> tuple:
    out, acc = [], 1
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


class Tracer:
    """What the watched load learned: checkpoint storages by name, parameter storages by name, the provenance of
    every other tensor computed from them, and the writes into parameters in order."""

    def __init__(self, params: dict):
        self.params = {_key(t): (n, t.storage_offset()) for n, t in reversed(list(params.items()))}
        self.sources: dict[int, str] = {}
        self.shapes: dict[str, int] = {}  # checkpoint name -> elements
        self.derived: dict[int, tuple] = {}  # storage -> (geometry, Map | Mixed)
        self.writes: list[Write] = []
        self.by_param: dict[str, list] = {}
        self.read: set[str] = set()
        self.keep: list = []  # every tensor keyed on stays alive: a storage's address is not reused
        self.turn: str | None = None

    def feed(self, items):
        """`items` (name, meta tensor) passed on to the loader, each one tagged first."""
        for name, t in items:
            self.sources[_key(t)] = name
            self.shapes[name] = t.numel()
            self.keep.append(t)
            self.turn = name
            yield name, t
        self.turn = None

    def prov(self, t: torch.Tensor):
        """A `Map` or a `Mixed` for tensor `t`, None when it holds nothing of the checkpoint."""
        k = _key(t)
        if k in self.derived:  # (before the checkpoint's own: a checkpoint tensor the loader wrote into)
            geo, what = self.derived[k]
            return _view_of(what, geo, _geometry(t))
        if k in self.sources:
            return Map(self.sources[k], *_geometry(t))
        if k in self.params:
            return self._param_prov(t)
        return None

    def _param_prov(self, t: torch.Tensor):
        """A parameter read back (vLLM's composed loaders: A = -exp(A) after the copy): the map of the last copy
        into exactly this view, else the sources of every write into the parameter so far."""
        name, base = self.params[_key(t)]
        off, sizes, strides = _geometry(t)
        mine = self.by_param.get(name, [])
        for w in reversed(mine):
            if (w.offset, w.sizes, w.strides) == (off - base, sizes, strides) and isinstance(w.what, Map):
                return w.what
        return Mixed(tuple(sorted({s for w in mine for s in _sources(w.what)}))) if mine else None

    def record(self, dst: torch.Tensor, what) -> None:
        """`what` written into `dst`: a write when `dst` is a parameter's view, else `dst`'s provenance."""
        k = _key(dst)
        for s in _sources(what):
            self.read.add(s)
        if k in self.params:
            if dst.numel() == 0:
                return
            name, base = self.params[k]
            off, sizes, strides = _geometry(dst)
            if isinstance(what, Map) and what.sizes != sizes:
                what = _broadcast(what, sizes)
            self.writes.append(Write(name, off - base, sizes, strides, what, self.turn))
            self.by_param.setdefault(name, []).append(self.writes[-1])
        elif what is not None or k in self.sources:
            if k in self.sources:  # the loader wrote into a checkpoint tensor (gpt-oss zeroes w2_bias off rank 0)
                whole = dst.numel() == self.shapes[self.sources[k]] and dst.storage_offset() == 0
                what = what if whole and not isinstance(what, Map) else Mixed((self.sources[k],))
            self.derived[k] = (_geometry(dst), what)
            self.keep.append(dst)

    def result(self, func, args: tuple, out) -> None:
        """Provenance of an op's fresh output from its inputs'."""
        inputs = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
        keys = {_key(a) for a in inputs}
        outs = [o for o in _flat([out]) if isinstance(o, torch.Tensor) and _key(o) not in keys]  # not views
        provs = [p for p in (self.prov(a) for a in inputs) if p is not None] if outs else []
        if not provs:
            return
        name = func.overloadpacket.__name__
        for o in outs:
            if name in ELEMENTWISE and len(provs) == 1 and isinstance(provs[0], Map) and len(inputs) == 1 \
                    and tuple(o.shape) == provs[0].sizes:
                p = provs[0]
                what = p if name in KEEP else Map(p.source, p.offset, p.sizes, p.strides, p.chain + (name,))
            else:
                what = Mixed(tuple(sorted({s for p in provs for s in _sources(p)})))
            self.derived[_key(o)] = (_geometry(o), what)
            self.keep.append(o)


def _flat(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flat(x)
        else:
            yield x


def _sources(what) -> tuple:
    if isinstance(what, Map):
        return (what.source,)
    if isinstance(what, Mixed):
        return what.sources
    return ()


def _broadcast(m: Map, sizes: tuple) -> Map:
    """`m` broadcast to `sizes` (copy_ broadcasts its source): new and extent-1 dims get stride 0."""
    lead = len(sizes) - len(m.sizes)
    strides = (0,) * lead + tuple(0 if n == 1 and s != 1 else st for n, s, st in zip(m.sizes, sizes[lead:], m.strides))
    return Map(m.source, m.offset, tuple(sizes), strides, m.chain)


def _view_of(what, geo: tuple, view: tuple):
    """The provenance of `view` (offset, sizes, strides) of a storage whose tensor `geo` has `what`: the same
    geometry keeps it; a contiguous view of the whole of a contiguous tensor (reshape) keeps a contiguous map."""
    if not isinstance(what, Map) or view == geo:
        return what
    (goff, gsizes, gstrides), (voff, vsizes, vstrides) = geo, view
    whole = math.prod(vsizes) == math.prod(gsizes) and voff == goff
    if whole and gstrides == _row_major(gsizes) and vstrides == _row_major(vsizes) \
            and what.strides == _row_major(what.sizes):
        return Map(what.source, what.offset, vsizes, _row_major(vsizes), what.chain)
    return Mixed((what.source,))


class _Watch(TorchDispatchMode):
    """Every aten op of the load, run (a write across devices is only recorded) and told to the `Tracer`."""

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tr = self.tracer
        if name == "copy_":
            dst, src = args[0], args[1]
            tr.record(dst, tr.prov(src))
            return func(*args, **kwargs) if dst.device == src.device else dst
        if name in ("fill_", "zero_"):
            value = 0.0 if name == "zero_" else args[1]
            tr.record(args[0], float(value) if not isinstance(value, torch.Tensor) else tr.prov(value) or Mixed(()))
            return func(*args, **kwargs)
        if name.endswith("_") and args and isinstance(args[0], torch.Tensor) and _key(args[0]) in tr.params:
            provs = [tr.prov(a) for a in _flat(args[1:]) if isinstance(a, torch.Tensor)]
            prior = tr.prov(args[0])
            tr.record(args[0], Mixed(tuple(sorted({s for p in provs + [prior] for s in _sources(p)}))))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        tr.result(func, args, out)
        return out


# ------------------------------------------------------------------------------ strided writes as boxes


def _unravel(flat: int, shape: tuple) -> list:
    out = []
    for n in reversed(shape):
        out.append(flat % n if n else 0)
        flat = flat // n if n else 0
    return list(reversed(out))


def _split(n: int, stride: int, shape: tuple, start: list) -> list:
    """One dim of a strided view (`n` elements `stride` apart in a contiguous tensor of `shape`, starting at
    coordinates `start`) as factors (size, dim of `shape`, step along it), inner first; NotABox where the walk
    is not regular in `shape`'s coordinates (a stride 0, a wrap that does not restart at the same place)."""
    pstr, out = _row_major(shape), []
    while n > 1:
        dims = [i for i, m in enumerate(shape) if m > 1 and pstr[i] <= stride]
        if not dims or stride % pstr[dims[0]]:
            raise NotABox(f"a stride of {stride} elements does not walk a dim of {list(shape)}")
        d = dims[0]
        step = stride // pstr[d]
        if start[d] + (n - 1) * step < shape[d]:
            out.append((n, d, step))
            return out
        inner = shape[d] // step
        if shape[d] % step or start[d] >= step or n % inner:
            raise NotABox(f"{n} elements {stride} apart wrap irregularly in {list(shape)}")
        out.append((inner, d, step))
        n, stride = n // inner, stride * inner
    return out


def _refine(a: list, b: list) -> list:
    """Two factorings (`_split`) of one dim as one: [(size, (dim, step) in a, (dim, step) in b)], inner first."""
    cuts = sorted({c for fs in (a, b) for c in _cum(fs)} | {1})
    if any(hi % lo for lo, hi in zip(cuts, cuts[1:])):
        raise NotABox(f"the region's and the source's walks do not nest ({a} against {b})")
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        out.append((hi // lo, _at(a, lo), _at(b, lo)))
    return out


def _cum(factors: list) -> list:
    out, acc = [], 1
    for size, _d, _s in factors:
        acc *= size
        out.append(acc)
    return out


def _at(factors: list, lo: int) -> tuple:
    """(dim, step) of the sub-dim starting at cumulative size `lo` inside `factors`."""
    acc = 1
    for size, d, step in factors:
        if lo < acc * size:
            return d, step * (lo // acc)
        acc *= size
    raise AssertionError("a cut past the factors")


def _walk(w: Write, pshape: tuple, sshape: tuple | None) -> tuple:
    """A write's logical dims as sub-dims (size, (param dim, step), (source dim, step) or None), with the start
    coordinates in the parameter and in the source."""
    estart = _unravel(w.offset, pshape)
    m = w.what if isinstance(w.what, Map) else None
    sstart = _unravel(m.offset, sshape) if m else None
    subs = []
    for k, n in enumerate(w.sizes):
        if n == 1:
            continue
        fe = _split(n, w.strides[k], pshape, estart)
        if m is None:
            subs += [(size, (d, step), None) for size, d, step in fe]
        else:
            subs += _refine(fe, _split(n, m.strides[k], sshape, sstart))
    return subs, estart, sstart


def _free_dims(subs: list, aligned: dict) -> tuple:
    """Sub-dims that extend a box (along one parameter dim, unit step, and for a copy the same step along the
    source dim aligned with it) and the others, enumerated: ({param dim: extent}, [sub-dims])."""
    by_dim, rest = {}, []
    for s in subs:
        (ed, es), src = s[1], s[2]
        ok = src is None or (aligned.get(ed) == src[0] and src[1] == es)
        (by_dim.setdefault(ed, []) if ok else rest).append(s)
    free = {}
    for d, group in by_dim.items():
        group.sort(key=lambda s: s[1][1])
        acc, chain = 1, []
        for s in group:
            if s[1][1] == acc:
                acc *= s[0]
                chain.append(s)
            else:
                rest.append(s)
        if acc > 1:
            free[d] = acc
    return free, rest


def _boxes_of(w: Write, pshape: tuple, sshape: tuple | None) -> tuple:
    """The write cut into boxes of the parameter: ([(lo, hi, source lo or None)], the dims pairing used); one
    box per value of each enumerated sub-dim (`_free_dims`)."""
    subs, estart, sstart = _walk(w, pshape, sshape)
    aligned = _alignment(subs, pshape, sshape) if sshape is not None else {}
    free, rest = _free_dims(subs, aligned)
    count = math.prod(s[0] for s in rest)
    if count > MAX_GROUPS:
        raise NotABox(f"a write into {w.param} is {count} separate boxes")
    out = []
    for idx in _product([s[0] for s in rest]):
        lo, slo = list(estart), list(sstart) if sstart is not None else None
        for v, (_n, (ed, es), src) in zip(idx, rest):
            lo[ed] += v * es
            if src is not None:
                slo[src[0]] += v * src[1]
        hi = [x + free.get(d, 1) for d, x in enumerate(lo)]
        out.append((lo, hi, slo))
    return out, aligned


def _alignment(subs: list, pshape: tuple, sshape: tuple) -> dict:
    """{param dim: source dim} for one copy: `_pairs`' (from the last dims), unless the write walks each
    parameter dim along one source dim of its own in another pairing (a loader that transposes: gpt-oss's
    experts), then that one, completed by `_pairs`' for the dims the write does not walk."""
    positional = _pairs(pshape, sshape)[0]
    walked: dict = {}
    for _n, (ed, es), src in subs:
        if src is None or src[1] != es or walked.setdefault(ed, src[0]) != src[0]:
            return positional
    if all(positional.get(e) == s for e, s in walked.items()) or len(set(walked.values())) < len(walked):
        return positional
    rest = {e: s for e, s in positional.items() if e not in walked and s not in walked.values()}
    out = {**walked, **rest}
    ek, sk = [i for i, n in enumerate(pshape) if n != 1], [i for i, n in enumerate(sshape) if n != 1]
    return out if len(out) == min(len(ek), len(sk)) else positional


def _leads(pshape: tuple, sshape: tuple, aligned: dict) -> tuple:
    """The parameter's and the source's dims (of extent over 1) that `aligned` does not pair."""
    return ([d for d, n in enumerate(pshape) if n != 1 and d not in aligned],
            [d for d, n in enumerate(sshape) if n != 1 and d not in aligned.values()])


def _product(sizes: list):
    if not sizes:
        yield ()
        return
    for v in range(sizes[0]):
        for rest in _product(sizes[1:]):
            yield (v, *rest)


def _pairs(pshape: tuple, sshape: tuple) -> tuple:
    """`derive._copies`' alignment: {param dim: source dim} for the dims of extent over 1 aligned from the
    last, the param's leading dims, the source's leading dims."""
    ek, sk = [i for i, n in enumerate(pshape) if n != 1], [i for i, n in enumerate(sshape) if n != 1]
    r = min(len(ek), len(sk))
    return dict(zip(ek[len(ek) - r:], sk[len(sk) - r:])), ek[:len(ek) - r], sk[:len(sk) - r]


def _minus(lo: list, hi: list, blo: list, bhi: list) -> list:
    """Box [lo, hi) less box [blo, bhi), as boxes."""
    if any(max(a, b) >= min(c, d) for a, b, c, d in zip(lo, blo, hi, bhi)):
        return [(lo, hi)]
    out, lo, hi = [], list(lo), list(hi)
    for d in range(len(lo)):
        if lo[d] < blo[d]:
            out.append((lo[:], hi[:d] + [blo[d]] + hi[d + 1:]))
            lo[d] = blo[d]
        if hi[d] > bhi[d]:
            out.append((lo[:d] + [bhi[d]] + lo[d + 1:], hi[:]))
            hi[d] = bhi[d]
    return out


def _merge(boxes: list) -> list:
    """Boxes joined wherever two touch along one dim and agree on the others."""
    boxes = [(list(lo), list(hi)) for lo, hi in boxes]
    joined = True
    while joined:
        joined = False
        for i in range(len(boxes)):
            for j in range(len(boxes)):
                if i == j:
                    continue
                (alo, ahi), (blo, bhi) = boxes[i], boxes[j]
                diff = [d for d in range(len(alo)) if (alo[d], ahi[d]) != (blo[d], bhi[d])]
                if len(diff) == 1 and ahi[diff[0]] == blo[diff[0]]:
                    boxes[i] = (alo, ahi[:diff[0]] + [bhi[diff[0]]] + ahi[diff[0] + 1:])
                    del boxes[j]
                    joined = True
                    break
            if joined:
                break
    return boxes


def _pieces(writes: list, pshape: tuple, shapes: dict) -> list:
    """The parameter's final state as disjoint boxes [(lo, hi, label)], later writes over earlier ones. A
    copy's label is ('copy', source, chain, (param dim, source dim, translation) per aligned pair, source
    leading coordinates)."""
    out: list = []  # [lo, hi, label] or None once cut
    starts: list = []  # (lo[0], index into out), sorted: the candidates an overlap is looked for among
    reach = 1  # the longest extent along dim 0 of any piece
    for w in writes:
        m = w.what if isinstance(w.what, Map) else None
        sshape = shapes[m.source] if m else None
        boxes, aligned = _boxes_of(w, pshape, sshape)
        slead = _leads(pshape, sshape, aligned)[1] if m else []
        for lo, hi, slo in boxes:
            if m:
                label = ("copy", m.source, m.chain, tuple((e, s, slo[s] - lo[e]) for e, s in sorted(aligned.items())),
                         tuple(slo[s] for s in slead))
            elif isinstance(w.what, Mixed):
                label = ("mixed", w.what.sources, w.turn)
            else:
                label = ("fill", w.what, w.turn)
            lo0, hi0 = (lo[0], hi[0]) if lo else (0, 1)
            near = starts[bisect.bisect_left(starts, (lo0 - reach + 1, -1)):bisect.bisect_left(starts, (hi0, -1))]
            for _s, i in near:
                if out[i] is not None and _overlaps(out[i][0], out[i][1], lo, hi):
                    plo, phi, lab = out[i]
                    out[i] = None
                    for a, b in _minus(plo, phi, lo, hi):
                        reach = _add(out, starts, (a, b, lab), reach)
            reach = _add(out, starts, (lo, hi, label), reach)
    return [p for p in out if p is not None]


def _add(out: list, starts: list, piece: tuple, reach: int) -> int:
    """`piece` appended to `out` and indexed in `starts`; the new longest extent along dim 0."""
    lo, hi = piece[0], piece[1]
    out.append(piece)
    bisect.insort(starts, (lo[0] if lo else 0, len(out) - 1))
    return max(reach, hi[0] - lo[0] if lo else 1)


def _overlaps(lo, hi, blo, bhi) -> bool:
    return all(max(a, b) < min(c, d) for a, b, c, d in zip(lo, blo, hi, bhi))


def _copy(label: tuple, lo: list, hi: list, pshape: tuple, sshape: tuple) -> Copy:
    """One box of a copy in `derive.Copy`'s terms; a pairing that is not in order is a permutation of the box
    (`formats.derived.permute_name`), after the chain's function."""
    _kind, source, chain, pairs, slead = label
    elead, sleads = _leads(pshape, sshape, {e: s for e, s, _t in pairs})
    region = [0] * len(pshape)
    for d in elead:
        region[d] = lo[d]
    offsets, sizes = [0] * len(sshape), [1] * len(sshape)
    for (e, s, t) in pairs:
        region[e] = slice(lo[e], hi[e])
        offsets[s], sizes[s] = lo[e] + t, hi[e] - lo[e]
    for s, c in zip(sleads, slead):
        offsets[s] = c
    paired = [s for _e, s, _t in pairs]  # (dims of extent 1 move freely)
    order = paired + [d for d in range(len(sshape)) if d not in paired]
    parts = [FUNCTIONS.get(chain, "?")] + ([derived.permute_name(tuple(order))] if paired != sorted(paired) else [])
    return Copy(source, tuple(offsets), tuple(sizes), tuple(region), "; ".join(p for p in parts if p) or None)


# ------------------------------------------------------------------------------ the derivation


def _param(name: str, t: torch.Tensor, writes: list, shapes: dict) -> tuple:
    """One parameter's `Param` from its writes, and its transformed loads [(source, param, function, count)]."""
    pshape = tuple(t.shape)
    pieces = _pieces(writes, pshape, shapes)
    groups: dict = {}
    transformed, loads, zeroed = {}, {}, 0
    for lo, hi, label in pieces:
        size = math.prod(b - a for a, b in zip(lo, hi))
        if label[0] == "copy" and label[2] in FUNCTIONS:
            elead = _leads(pshape, shapes[label[1]], {e: s for e, s, _t in label[3]})[0]
            groups.setdefault(label + tuple(lo[d] for d in elead), []).append((lo, hi))
        elif label[0] == "copy":
            transformed[label[1]] = transformed.get(label[1], 0) + size
            loads[(label[1], None)] = loads.get((label[1], None), 0) + size
        elif label[0] == "fill" and label[1] == 0.0:
            zeroed += size
        else:
            transformed[label[2]] = transformed.get(label[2], 0) + size
            loads[(label[2], None)] = loads.get((label[2], None), 0) + size
    copies = [_copy(key[:5], lo, hi, pshape, shapes[key[1]]) for key, boxes in groups.items()
              for lo, hi in _merge(boxes)]
    for c in copies:
        if c.transform is not None:
            loads[(c.source, c.transform)] = loads.get((c.source, c.transform), 0) + math.prod(c.sizes)
    plain = sorted((c for c in copies if c.transform is None), key=lambda c: _norm(c.region, pshape))
    done = sorted((c for c in copies if c.transform is not None), key=lambda c: _norm(c.region, pshape))
    written = sum(math.prod(b - a for a, b in zip(lo, hi)) for lo, hi, _l in pieces)
    p = Param(name, pshape, str(t.dtype).removeprefix("torch."), tuple(plain + done), transformed, zeroed,
              t.numel() - written)
    return p, [(s, name, f, n) for (s, f), n in loads.items()]


def _meta_model(config: dict, build, dtype: str):
    """The rank's model on the meta device, or one ConfigError saying why vLLM cannot build it there."""
    try:
        return _built(config, build, dtype, "meta")  # (what this vLLM cannot build at all: one ConfigError)
    except NotImplementedError as e:
        raise NotOnMeta(f"vLLM cannot build {config.get('architectures')} on the meta device (a data-dependent "
                          f"op at construction): {' '.join(str(e).split())[:200]}", key="config") from e


def derive_meta(config: dict, *, tp_size: int = 1, tp_rank: int = 0, dtype: str = "bfloat16",
                expert_parallel: bool = False, expert_placement: str = "linear",
                checkpoint: dict | None = None, dp_size: int = 1, dp_rank: int = 0, pp_size: int = 1,
                pp_rank: int = 0, all2all: str = ALL2ALL_DEFAULT) -> Derived:
    """`derive.derive` of `config` at any size: the model on the meta device, its load traced (module doc)."""
    t0 = time.perf_counter()
    spec = {n: tuple(s) for n, s in (checkpoint.items() if checkpoint is not None else hf_checkpoint(config).items())}
    with _vllm(config, tp_size, tp_rank, expert_parallel, expert_placement, dp_size, dp_rank, pp_size,
               pp_rank, all2all) as build:
        model, vc = _meta_model(config, build, dtype)
        tensors = _tensors(model)
        tracer = Tracer(tensors)
        before = {n: _key(t) for n, t in tensors.items()}
        items = [(n, torch.empty(s, dtype=vc.model_config.dtype, device="meta")) for n, s in spec.items()]
        with _Watch(tracer):
            compat.load_under(vc, model, tracer.feed(items))
        swapped = [n for n, t in _tensors(model).items() if n in before and _key(t) != before[n]]
        if swapped:
            raise NotABox(f"vLLM's loader replaced the storage of {swapped[:3]} (param.data = ...), which this "
                          f"trace does not follow")
    by_param: dict = {}
    for w in tracer.writes:
        by_param.setdefault(w.param, []).append(w)
    buffers = {n for n, _ in model.named_buffers()}
    params, loads = {}, []
    for n, t in tensors.items():
        if n in buffers and n not in by_param:
            continue
        params[n], more = _param(n, t, by_param.get(n, []), spec)
        loads += more
    placed = {c.source for p in params.values() for c in p.copies} | {s for p in params.values() for s in p.transformed}
    placed |= {s for w in tracer.writes if isinstance(w.what, Mixed) for s in w.what.sources}
    return Derived(dict(config), tp_size, tp_rank, params, tuple(loads), tuple(n for n in spec if n not in placed),
                   spec, time.perf_counter() - t0, expert_parallel, expert_placement, dp_size, dp_rank, pp_size,
                   pp_rank, all2all)
