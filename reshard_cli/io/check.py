"""`reshard check`: prove an output directory (`reshard run --out`) against its source, without torchrun.

For every destination rank of the dst layout and every tensor that rank holds, the shard in
`rank-NNNNN.safetensors` must be exactly the slice of the source tensor that the dst layout places there
(raw bytes, element by element), and the manifest's checksum must be the checksum of the file's shard.
The manifest itself must describe the layouts given: every dst rank present, the rank numbers, shapes,
offsets and dtypes the dst layout says.

One pass, zero copies where possible: each rank file is mapped into memory (`io.mapped`: our restricted
header parse, no pickle) and its shards are views of the mapping; a safetensors source is mapped the same
way (`Source.view`), synthetic values are generated per block at copy speed. Each block is compared with the
source's block as int64 words and checksummed in the same pass (`verify.RowChecksum`, bit for bit the value
`verify.checksum` gives). Memory stays bounded: one block of one shard at a time (at most `BLOCK_ELEMS`
elements, split along the first dims so that a block is a dense sub-box). Files that cannot be mapped are read
with `safe_open(...).get_slice`, sources without a view with `Source.read`, block by block.
"""
from __future__ import annotations

import functools
import itertools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from reshard_cli.io import sinks
from reshard_cli.transfer import verify
from reshard_cli.errors import ConfigError
from reshard_cli.plan.geometry import Box
from reshard_cli.spec.layout import Layout
from reshard_cli.spec.models import _SAFETENSORS_DTYPES
from reshard_cli.io.mapped import MappedSafetensors
from reshard_cli.io.sources import Source, SyntheticSource, open_source, synthetic_values

# Elements per block (4 Mi). The file's block is a view of the mapped file; what is allocated stays under
# ~150 MiB at any tensor size: the source's block when it is generated, read or realigned (32 MiB each at most,
# for 8-byte types), the checksum's float64 steps (2 MiB) and per-row tensors (at most _MAX_ROWS rows), and
# for synthetic values one period and its windows (~2 MiB + one block). Big enough to keep per-block overhead low.
BLOCK_ELEMS = 1 << 22
_MAX_ROWS = 1 << 18

@dataclass
class Problem:
    """One thing wrong with the output. `index`/`rank` are None for problems of the whole directory."""

    kind: str              # manifest | file | missing | extra | shape | dtype | values | checksum
    message: str
    index: int | None = None
    rank: int | None = None
    tensor: str | None = None
    count: int | None = None              # differing elements (kind "values")
    first_index: list | None = None       # global multi-dim index of the first differing element
    local_index: list | None = None       # the same inside the shard

    def text(self) -> str:
        where = "output" if self.index is None else f"rank {self.rank} ({sinks.rank_file_name(self.index)})"
        if self.tensor is not None:
            where += f" tensor {self.tensor!r}"
        return f"{where}: {self.message}"


@dataclass
class RankResult:
    index: int
    rank: int
    file: str
    tensors: int = 0          # tensors whose values were compared
    bytes: int = 0            # bytes compared
    mismatches: int = 0       # problems on this rank
    checksum_ok: bool | None = None   # None: no manifest entry or no file to compare with


@dataclass
class CheckResult:
    model: str
    src: str
    dst: str
    out: str
    source: str
    ranks: list[RankResult] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.ranks)

    @property
    def tensors(self) -> int:
        return sum(r.tensors for r in self.ranks)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"ok": self.ok, "model": self.model, "src": self.src, "dst": self.dst, "out": self.out,
                "source": self.source, "seconds": self.seconds, "bytes": self.bytes, "tensors": self.tensors,
                "gbps": self.gbps, "ranks": [asdict(r) for r in self.ranks],
                "problems": [asdict(p) for p in self.problems]}

    def text(self, limit: int = 50) -> str:
        from reshard_cli.report import fmt_bytes, table

        lines = [f"reshard check: {self.model}  {self.src} -> {self.dst} ({len(self.ranks)} ranks)  "
                 f"source {self.source}  out {self.out}"]
        if self.problems:
            lines.append(f"  {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}:")
            lines += [f"    {p.text()}" for p in self.problems[:limit]]
            if len(self.problems) > limit:
                lines.append(f"    ... {len(self.problems) - limit} more (use --json)")
        rows = [[r.rank, r.file, r.tensors, fmt_bytes(r.bytes), r.mismatches,
                 {True: "ok", False: "WRONG", None: "-"}[r.checksum_ok]] for r in self.ranks]
        lines.append(table(["rank", "file", "tensors", "bytes", "mismatches", "checksum"], rows))
        state = "all ok" if self.ok else f"FAILED: {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        lines.append(f"  total {self.tensors} tensors, {fmt_bytes(self.bytes)} checked in {self.seconds:.2f} s "
                     f"({self.gbps:.2f} GB/s)  {state}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ blocks


def blocks(sizes: tuple[int, ...], max_elems: int = BLOCK_ELEMS) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(local offsets, sizes) of dense sub-boxes tiling a box of `sizes` in row-major order, each of at most
    `max_elems` elements (or one element, when a single element is more)."""
    n = len(sizes)
    if n == 0:
        yield (), ()
        return
    if any(s == 0 for s in sizes):
        return
    trailing = [1] * (n + 1)  # trailing[k] = prod(sizes[k:])
    for k in range(n - 1, -1, -1):
        trailing[k] = trailing[k + 1] * sizes[k]
    d = next(k for k in range(n) if trailing[k + 1] <= max_elems)  # k = n - 1 always qualifies
    step = max(1, max_elems // trailing[d + 1])
    for outer in itertools.product(*(range(s) for s in sizes[:d])):
        for a in range(0, sizes[d], step):
            yield outer + (a,) + (0,) * (n - d - 1), (1,) * d + (min(step, sizes[d] - a),) + tuple(sizes[d + 1:])


def _unravel(flat: int, sizes: tuple[int, ...]) -> list[int]:
    out = []
    for s in reversed(sizes):
        out.append(flat % s)
        flat //= s
    return list(reversed(out))


# ------------------------------------------------------------------------------------------------ check


def _first_holders(layout: Layout) -> list[int]:
    """A few ranks that together hold every tensor (the first holder of each), for `Source.check`."""
    return sorted({p.holders[0] for p in set(layout.placements) if p.holders})


def check_output(src_layout: Layout, dst_layout: Layout, out_dir: str | Path, source: Any = None, *,
                 block_elems: int = BLOCK_ELEMS) -> CheckResult:
    """Check the output directory `out_dir` against `source` and the two layouts.

    `source` is a `Source`, or a spec as `open_source` takes (None: the src layout's `source:` key, or
    synthetic). A missing or unreadable manifest, a bad layout or source is a ConfigError (exit 2);
    everything wrong with the output itself is a `Problem` in the result.
    """
    out = Path(out_dir)
    t0 = time.perf_counter()
    doc = sinks.read_manifest(out)  # ConfigError naming the file when missing or corrupt
    mfile = str(out / sinks.MANIFEST_NAME)
    own = not isinstance(source, Source)
    src = open_source(source if source is not None else src_layout.source, src_layout,
                      base_dir=Path(src_layout.file).parent) if own else source
    try:
        for r in _first_holders(src_layout):
            src.check(src_layout, r)
        result = CheckResult(model=src_layout.manifest.name, src=src_layout.name, dst=dst_layout.name,
                             out=str(out), source=src.description or src.kind)
        _check_manifest_top(doc, src_layout, dst_layout, result)
        entries = _manifest_entries(doc, mfile, dst_layout, result)
        scratch = _Scratch()
        for i, grank in enumerate(dst_layout.ranks):
            _check_rank(i, grank, entries.get(i), out, src, src_layout, dst_layout, result, block_elems, scratch)
        wanted = {sinks.rank_file_name(i) for i in range(dst_layout.size)}
        for p in sorted(out.glob("rank-*.safetensors")):
            if p.name not in wanted:
                result.problems.append(Problem("extra", f"extra rank file {p.name}: the dst layout has "
                                                        f"{dst_layout.size} ranks"))
    finally:
        if own:
            src.close()
    result.seconds = time.perf_counter() - t0
    return result


def _check_manifest_top(doc: dict, src_l: Layout, dst_l: Layout, result: CheckResult) -> None:
    if doc.get("model") is not None and doc.get("model") != src_l.manifest.name:
        result.problems.append(Problem("manifest", f"manifest is for model {doc.get('model')!r}, the layouts "
                                                   f"for {src_l.manifest.name!r}"))
    dst_doc = doc.get("dst")
    ranks = dst_doc.get("ranks") if isinstance(dst_doc, dict) else None
    if isinstance(ranks, list) and ranks != list(dst_l.ranks):
        result.problems.append(Problem("manifest", f"manifest's dst ranks {_span(ranks)} differ from the dst "
                                                   f"layout's {_span(dst_l.ranks)}"))


def _span(ranks) -> str:
    ranks = list(ranks)
    if ranks and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return str(ranks)


def _manifest_entries(doc: dict, mfile: str, dst_l: Layout, result: CheckResult) -> dict[int, dict]:
    entries: dict[int, dict] = {}
    for j, r in enumerate(doc["ranks"]):
        if not (isinstance(r, dict) and isinstance(r.get("tensors"), dict)
                and isinstance(r.get("index"), int) and isinstance(r.get("rank"), int)):
            raise ConfigError("expected {index, rank, file, tensors}", file=mfile, key=f"ranks[{j}]")
        i = r["index"]
        if not 0 <= i < dst_l.size:
            result.problems.append(Problem("manifest", f"manifest lists rank index {i} (rank {r['rank']}), the "
                                                       f"dst layout has {dst_l.size} ranks"))
        elif i in entries:
            result.problems.append(Problem("manifest", f"manifest lists rank index {i} twice"))
        else:
            entries[i] = r
    return entries


def _check_rank(i: int, grank: int, entry: dict | None, out: Path, src: Source, src_l: Layout, dst_l: Layout,
                result: CheckResult, block_elems: int, scratch: "_Scratch") -> None:
    man = dst_l.manifest.tensors
    fname = sinks.rank_file_name(i)
    rr = RankResult(index=i, rank=grank, file=fname)
    result.ranks.append(rr)
    before = len(result.problems)

    def problem(kind: str, message: str, tensor: str | None = None, **kw) -> None:
        result.problems.append(Problem(kind, message, index=i, rank=grank, tensor=tensor, **kw))

    expected = {man[t].name: (t, box) for t, box in dst_l.held(grank)}
    # 1. the manifest's entry against the dst layout
    listed: dict = {}
    if entry is None:
        problem("manifest", "manifest is incomplete: it has no entry for this rank of the dst layout")
    else:
        listed = entry["tensors"]
        if entry["rank"] != grank:
            problem("manifest", f"manifest says global rank {entry['rank']}, the dst layout has {grank}")
        if entry.get("file", fname) != fname:
            problem("manifest", f"manifest names file {entry.get('file')!r}, expected {fname}")
        for name in listed:
            if name not in expected:
                problem("manifest", "manifest lists a tensor that the dst layout does not place on this rank",
                        name)
        for name, (t, box) in expected.items():
            e = listed.get(name)
            if e is None:
                problem("manifest", "missing from the manifest", name)
                continue
            if not isinstance(e, dict):
                problem("manifest", "manifest entry is not a mapping", name)
                continue
            want = {"shape": list(man[t].shape), "offsets": list(box.offsets), "local_shape": list(box.sizes),
                    "dtype": man[t].dtype}
            for key, value in want.items():
                if e.get(key) != value:
                    problem("manifest", f"manifest {key} {e.get(key)}, the dst layout says {value}", name)
    # 2. the file against the source
    path = out / fname
    if not path.is_file():
        problem("file", f"rank file {fname} is missing")
        rr.checksum_ok = False if entry is not None else None
        rr.mismatches = len(result.problems) - before
        return
    from safetensors import safe_open
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for corrupt files
        problem("file", f"cannot open {fname}: {e}")
        rr.checksum_ok = False if entry is not None else None
        rr.mismatches = len(result.problems) - before
        return
    try:  # the file's shards as views of the mapped file (no copy); None: read slices with safe_open
        mapped: MappedSafetensors | None = MappedSafetensors(path)
    except (ConfigError, OSError, ValueError):
        mapped = None
    checksums_ok = entry is not None
    try:
        keys = set(handle.keys())
        for name in sorted(keys - expected.keys()):
            problem("extra", f"extra tensor in {fname} (the dst layout does not place it on this rank)", name)
        for name, (t, box) in expected.items():
            if name not in keys:
                problem("missing", f"missing from {fname}", name)
                checksums_ok = False
                continue
            sl = handle.get_slice(name)
            shape, code = tuple(sl.get_shape()), sl.get_dtype()
            dtype = _SAFETENSORS_DTYPES.get(code, code)
            spec = man[t]
            if shape != box.sizes:
                problem("shape", f"shape {list(shape)} in {fname}, the dst layout's shard is {list(box.sizes)}", name)
            if dtype != spec.dtype:
                problem("dtype", f"dtype {dtype} in {fname}, the model says {spec.dtype}", name)
            if shape != box.sizes or dtype != spec.dtype:
                checksums_ok = False
                continue
            got = mapped.tensor(name) if mapped is not None else None
            if got is not None and (tuple(got.shape) != box.sizes or got.dtype != getattr(torch, spec.dtype)):
                got = None  # the file changed since safe_open read it: take the slow path, which reports it
            n, first, csum, nbytes = _compare(sl, src, src_l.manifest.index(name), box, spec.shape, block_elems,
                                              got, scratch)
            rr.tensors += 1
            rr.bytes += nbytes
            if n:
                local = [g - o for g, o in zip(first, box.offsets)]
                problem("values", f"{n} element{'s' if n != 1 else ''} differ{'s' if n == 1 else ''} from the "
                                  f"source, first at {first} (shard index {local})", name,
                        count=n, first_index=first, local_index=local)
            e = listed.get(name) if isinstance(listed.get(name), dict) else None
            if e is not None:
                if e.get("checksum") != verify.fmt(csum):
                    problem("checksum", f"checksum of the file's shard is {verify.fmt(csum)}, the manifest says "
                                        f"{e.get('checksum')}", name)
                    checksums_ok = False
            else:
                checksums_ok = False
    finally:
        del handle
        got = None
        if mapped is not None:
            mapped.close()
    rr.checksum_ok = checksums_ok if entry is not None else None
    rr.mismatches = len(result.problems) - before


def _compare(sl, src: Source, t_src: int, box: Box, shape: tuple, block_elems: int,
             got_all: torch.Tensor | None = None, scratch: "_Scratch | None" = None
             ) -> tuple[int, list | None, int, int]:
    """Compare one shard with the source, block by block: (differing elements, first differing global index,
    checksum of the file's shard, bytes compared).

    One pass over the file's shard (`got_all`, a view of the mapped file, or else slices read through
    safe_open): each block, seen as rows [rows, last dim], is compared with the source's block as int64 words
    and fed to the checksum (`verify.RowChecksum`, the same value as `verify.checksum`). The source's block is
    a view of the source when it has one (`Source.view`), synthetic values generated at copy speed, or
    `Source.read`. For synthetic values the checksum's row sums come from the values themselves when the block
    equals them (rows repeat: see `_SyntheticRows`), so the file is read once, by the comparison."""
    scratch = scratch or _Scratch()
    expected = _expected_blocks(src, t_src, box)
    count, first, csum, nbytes = 0, None, 0, 0
    # at most _MAX_ROWS rows per block: the per-row tensors (ids, sums, weights) stay small for narrow shards
    limit = min(block_elems, max(1, box.sizes[-1] if box.sizes else 1) * _MAX_ROWS)
    for offs, sizes in blocks(box.sizes, limit):
        sub = Box(tuple(o + a for o, a in zip(box.offsets, offs)), sizes)
        local = tuple(slice(a, a + s) for a, s in zip(offs, sizes))
        got = got_all[local] if got_all is not None else sl[local]
        rows = verify.row_ids(sub, shape)
        ncols = sizes[-1] if sizes else 1
        got2 = got.reshape(rows.numel(), ncols)  # a view: the block is dense in the shard
        want, derived = expected(sub, rows, got2, scratch)
        same = _same_bits(got2, want, scratch)
        if not same:
            diff = verify.differing(got2, want)
            if diff is not None:  # only then count and locate the differing elements
                n = int(diff.sum())
                if first is None:
                    pos = int(torch.argmax(diff.to(torch.uint8)))
                    first = [o + v for o, v in zip(sub.offsets, _unravel(pos, sizes))]
                count += n
            else:
                same = True
        cs = verify.RowChecksum(sub, shape, got.element_size(), scratch.f64, rows)
        sums = derived(cs) if derived is not None and same else None  # the source's own row sums, if it has them
        if sums is not None:  # the file's rows are the source's, bit for bit: so are their checksum terms
            cs.set_row_sums(0, sums)
        else:
            cs.update(0, got2)
        csum += cs.value()
        nbytes += got.numel() * got.element_size()
    return count, first, csum & ((1 << 64) - 1), nbytes


class _Scratch:
    """Buffers reused by every block of one check: the source's block when it must be copied or generated,
    and the checksum's float64 steps."""

    def __init__(self):
        self.f64 = verify.checksum_buffer()
        self._raw = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]

    def like(self, x: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """An uninitialised contiguous tensor of `x`'s shape and dtype whose address is `x`'s mod 8 (so the two
        compare as int64 words), in buffer `slot` (0: the source's values, 1: `_same_bits`' copies). Valid until
        the next call for the same slot."""
        nbytes = x.numel() * x.element_size()
        raw = self._raw[slot]
        if raw.numel() < nbytes + 8:
            raw = self._raw[slot] = torch.empty(max(nbytes + 8, 2 * raw.numel()), dtype=torch.uint8)
        shift = (x.data_ptr() - raw.data_ptr()) % 8
        if shift % x.element_size():  # x itself is misaligned: any address will do
            shift = 0
        return raw[shift:shift + nbytes].view(x.dtype).view(x.shape)


def _same_bits(got: torch.Tensor, want: torch.Tensor, scratch: _Scratch) -> bool:
    """`verify.differing(got, want) is None` (bit for bit equal), fast: compared as int64 words. `got` is a
    contiguous block of rows; `want` may be strided (rows of a source view)."""
    if (got.shape != want.shape or got.dtype != want.dtype or got.device.type != "cpu"
            or want.device.type != "cpu" or not got.is_contiguous()):
        return verify.differing(got, want) is None
    if not want.is_contiguous() or (want.data_ptr() - got.data_ptr()) % 8:
        if got.element_size() < 8 and got.dim() == 2:
            try:  # strided rows, each a whole number of aligned words: compare them in place
                return torch.equal(got.view(torch.int64), want.view(torch.int64))
            except RuntimeError:
                pass
        w = scratch.like(got, 1)
        w.copy_(want)
        want = w
    n = got.numel() * got.element_size()
    a, b = got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
    head = min((-got.data_ptr()) % 8, n)
    end = head + (n - head) // 8 * 8
    try:
        if not torch.equal(a[head:end].view(torch.int64), b[head:end].view(torch.int64)):
            return False
    except RuntimeError:  # storage offsets not aligned like the addresses: compare bytes
        return torch.equal(a, b)
    return (not head or torch.equal(a[:head], b[:head])) and (end == n or torch.equal(a[end:], b[end:]))


def _expected_blocks(src: Source, t: int, box: Box):
    """The source's values of `box`'s blocks: a function (block, its global row ids, the file's block as rows,
    scratch) -> (the source's block as rows [rows, last dim], a function giving its exact checksum row sums or
    None). From a view of the source, synthetic values generated into scratch, or `src.read` of the block."""
    spec = src.manifest.tensors[t]
    inside = len(box.sizes) == len(spec.shape) and all(
        0 <= o and o + s <= n for o, s, n in zip(box.offsets, box.sizes, spec.shape))
    if inside and not box.empty:  # else `read` raises the source's own error
        if isinstance(src, SyntheticSource) and spec.shape:
            fast = _SyntheticBlocks.make(t, spec.shape, getattr(torch, spec.dtype), src.seed, box)
            if fast is not None:
                return fast.block
        full = src.view(t)
        if full is not None:
            return lambda sub, rows, like, scratch: (_as_rows(full[sub.slices()], rows.numel()), None)
    return lambda sub, rows, like, scratch: (_as_rows(src.read(t, sub), rows.numel()), None)


def _as_rows(block: torch.Tensor, nrows: int) -> torch.Tensor:
    """`block` as [rows, last dim]: a view unless its dims do not merge (a strided view of the source)."""
    return block.reshape(nrows, -1) if block.dim() else block.reshape(1, 1)


_PERIOD = 1 << 16


class _SyntheticBlocks:
    """`synthetic_values` of blocks of one tensor, at copy speed, and their checksum row sums.

    The generator's hash keeps the low 16 bits of `i * 2654435761 ^ key` (i the global flat index, key from the
    tensor index and the seed), and those depend on `i mod 2^16` only: the values repeat with period 2^16. So one
    period, P[j] = value(hash(j)), holds every value, and a block's row that starts at flat index s is
    P[s mod 2^16:][:ncols] (wrapping): row s mod 2^16 of a strided (2^16, ncols) window view of P repeated. One
    `index_select` of the rows' starts copies the block. `make` checks the period against the generator itself
    once per (dtype, seed) and returns None (callers then use the generator) if it ever differs.

    Rows with the same start hold the same values, so the same checksum row sum (`verify.RowChecksum`), and a
    2-D tensor's rows have few distinct starts (its width times the row number, mod 2^16: 256 of them for a
    width of 256). When the file's block equals the values, each distinct row is summed once per tensor and
    looked up for every row: the file is read once, by the comparison.
    """

    def __init__(self, period: torch.Tensor, shape: tuple, rows: int):
        self.period, self.shape, self.rows = period, shape, rows
        self._windows: dict[int, torch.Tensor] = {}
        # (columns, first column) -> (exact checksum row sum of each window row, which of them are known)
        self._sums: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def make(t: int, shape: tuple, dtype: torch.dtype, seed: int, box: Box) -> "_SyntheticBlocks | None":
        """For the blocks of shard `box` of tensor `t` (None: use the generator)."""
        if not -(1 << 63) <= seed * 97 < (1 << 63):
            return None  # the generator's int64 arithmetic would not take it: let it say so
        tables = _synthetic_tables(dtype, seed)
        if tables is None:
            return None
        base, values = tables
        key = ((t + 1) * 40503) ^ (seed * 97)
        rows = 1
        for n in box.sizes[:-1]:
            rows *= n
        return _SyntheticBlocks(values.index_select(0, base ^ (key & 0xFFFF)), shape, rows)

    def _window(self, ncols: int) -> torch.Tensor:
        w = self._windows.get(ncols)
        if w is None:
            ext = self.period.repeat(-(-(_PERIOD + ncols) // _PERIOD))[:_PERIOD + ncols]
            w = self._windows[ncols] = ext.as_strided((_PERIOD, ncols), (1, 1))
        return w

    def block(self, sub: Box, rows: torch.Tensor, like: torch.Tensor, scratch: _Scratch):
        """(The values of block `sub` (global row ids `rows`) as [rows, last dim] in scratch, aligned like
        `like`; a function RowChecksum -> their exact row sums, or None when the shard's rows repeat too little
        for that to pay)."""
        ncols, col0 = sub.sizes[-1], sub.offsets[-1]
        starts = (rows * self.shape[-1] + col0) & (_PERIOD - 1)  # flat index of each row's start, mod 2^16
        window = self._window(ncols)
        shape = (starts.numel(), ncols)
        out = scratch.like(like) if like.dtype == self.period.dtype and tuple(like.shape) == shape \
            else torch.empty(shape, dtype=self.period.dtype)
        torch.index_select(window, 0, starts, out=out)

        def row_sums(cs: verify.RowChecksum) -> torch.Tensor | None:
            table = self._sums.get((ncols, col0))
            if table is None:
                table = self._sums[(ncols, col0)] = (torch.zeros(_PERIOD, dtype=torch.int64),
                                                     torch.zeros(_PERIOD, dtype=torch.bool))
            sums, have = table
            need = torch.zeros(_PERIOD, dtype=torch.bool)
            need[starts] = True
            need &= ~have
            todo = need.nonzero().reshape(-1)
            if 2 * todo.numel() > self.rows:  # the shard's rows hardly repeat: summing the file's costs less
                return None
            if todo.numel():
                sums[todo] = cs.row_sums(window.index_select(0, todo))
                have[todo] = True
            return sums[starts]
        return out, row_sums


@functools.lru_cache(maxsize=32)
def _synthetic_tables(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(base, values) with synthetic_values(t, flat index j) = values[base[j] ^ (key(t, seed) & 0xFFFF)] for j
    in one period: base[j] = (j * 2654435761) & 0xFFFF and values[h] the value of hash h. Checked against the
    generator for two tensor indices; None if they differ (a changed generator: use it directly)."""
    j = torch.arange(_PERIOD, dtype=torch.int64)
    base = ((j * 2654435761) & 0xFFFF).to(torch.int32)
    h = j
    if dtype == torch.bool:
        values = (h & 1).bool()
    elif dtype.is_floating_point:
        values = (h.to(torch.float32) / 32768 - 1).to(dtype)
    else:
        values = (h % 127).to(dtype)
    full = Box((0,), (_PERIOD,))
    for t in (0, 5):
        want = synthetic_values(t, full, (_PERIOD,), dtype, seed)
        got = values.index_select(0, base ^ ((((t + 1) * 40503) ^ (seed * 97)) & 0xFFFF))
        if verify.differing(got, want) is not None:
            return None
    return base, values


__all__ = ["BLOCK_ELEMS", "Problem", "RankResult", "CheckResult", "blocks", "check_output"]
