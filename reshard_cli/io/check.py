"""`reshard check`: prove an output directory (`reshard run --out`) against its source, without torchrun.

For every destination rank of the dst layout and every tensor that rank holds, the shard in
`rank-NNNNN.safetensors` must be exactly the slice of the source tensor that the dst layout places there
(raw bytes, element by element), and the manifest's checksum must be the checksum of the file's shard.
The manifest itself must describe the layouts given: every dst rank present, the rank numbers, shapes,
offsets and dtypes the dst layout says.

One pass, zero copies where possible, and no torch unless the source needs it (numpy only: the command starts
in a fraction of the time importing torch takes). Each rank file is mapped into memory (`io.mapped`: our
restricted header parse, no pickle) and its shards are raw-bits views of the mapping (int16 for bf16, ...); a
safetensors source is mapped the same way (`Source.array`); synthetic values are generated per block in numpy
(`synthetic.synthetic_fill`, the code `SyntheticSource.read` runs: each span of 2^20 elements is a copy of the
dtype's period of values from the span's own rotation); other sources are read with `Source.read` (torch),
block by block. Each block is compared as int64 words and checksummed in the same pass (`rowsum.RowChecksum`,
bit for bit the value `checksums.checksum` gives). The shards of a rank file are compared on a few threads (`_Workers`); problems are
reported in the same order either way. Memory stays bounded: one block of one shard at a time per thread (at
most `BLOCK_ELEMS` elements, split along the first dims so that a block is a dense sub-box).
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from reshard_cli.io import sinks
from reshard_cli.base import rowsum
from reshard_cli.base.text import fmt_bytes, table
from reshard_cli.errors import ConfigError
from reshard_cli.base.geometry import Box
from reshard_cli.layouts.layout import Layout
from reshard_cli.io.mapped import MappedSafetensors
from reshard_cli.io.sources import Source, SyntheticSource, open_source
from reshard_cli.io.synthetic import synthetic_fill, synthetic_key, synthetic_period, synthetic_table

# Elements per block (4 Mi). The file's block is a view of the mapped file; what is allocated stays under
# ~150 MiB per thread at any tensor size: the source's block when it is generated, read or realigned (32 MiB
# each at most, for 8-byte types), the checksum's float64 steps (2 MiB) and per-row arrays (at most _MAX_ROWS
# rows), and for synthetic values the generator's words and indices (~6 MiB). Big enough to keep per-block
# overhead low.
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

    bytes = property(lambda self: sum(r.bytes for r in self.ranks), doc="bytes compared, all ranks")
    tensors = property(lambda self: sum(r.tensors for r in self.ranks), doc="shards compared, all ranks")

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"ok": self.ok, "model": self.model, "src": self.src, "dst": self.dst, "out": self.out,
                "source": self.source, "seconds": self.seconds, "bytes": self.bytes, "tensors": self.tensors,
                "gbps": self.gbps, "ranks": [asdict(r) for r in self.ranks],
                "problems": [asdict(p) for p in self.problems]}

    def text(self, limit: int = 50) -> str:
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
        with _Workers() as workers:
            for i, grank in enumerate(dst_layout.ranks):
                _check_rank(i, grank, entries.get(i), out, src, src_layout, dst_layout, result, block_elems, workers)
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
                result: CheckResult, block_elems: int, workers: "_Workers") -> None:
    man = dst_l.manifest.tensors
    fname = sinks.rank_file_name(i)
    rr = RankResult(index=i, rank=grank, file=fname)
    result.ranks.append(rr)
    before = len(result.problems)

    def problem(kind: str, message: str, tensor: str | None = None, **kw) -> None:
        result.problems.append(Problem(kind, message, index=i, rank=grank, tensor=tensor, **kw))

    expected = {man[t].name: (t, box) for t, box in dst_l.held(grank)}
    listed = _check_entry(entry, expected, man, grank, fname, problem)
    ok = _check_file(out / fname, expected, listed, src, src_l, man, rr, problem, block_elems, workers)
    rr.checksum_ok = ok if entry is not None else None
    rr.mismatches = len(result.problems) - before


def _check_entry(entry: dict | None, expected: dict, man, grank: int, fname: str, problem) -> dict:
    """Step 1: the manifest's entry for a rank against the dst layout. Returns the tensors it lists."""
    if entry is None:
        problem("manifest", "manifest is incomplete: it has no entry for this rank of the dst layout")
        return {}
    listed = entry["tensors"]
    if entry["rank"] != grank:
        problem("manifest", f"manifest says global rank {entry['rank']}, the dst layout has {grank}")
    if entry.get("file", fname) != fname:
        problem("manifest", f"manifest names file {entry.get('file')!r}, expected {fname}")
    for name in listed:
        if name not in expected:
            problem("manifest", "manifest lists a tensor that the dst layout does not place on this rank", name)
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
    return listed


def _check_file(path: Path, expected: dict, listed: dict, src: Source, src_l: Layout, man, rr: "RankResult",
                problem, block_elems: int, workers: "_Workers") -> bool:
    """Step 2: a rank file against the source: its header (our restricted parser), then its tensors as views
    of the mapping, compared on the workers. Returns whether every checksum matched the manifest's."""
    fname = path.name
    if not path.is_file():
        problem("file", f"rank file {fname} is missing")
        return False
    try:
        mapped = MappedSafetensors(path)
    except (ConfigError, OSError, ValueError) as e:
        problem("file", f"cannot open {fname}: {e}")
        return False
    try:
        keys = set(mapped.header)
        for name in sorted(keys - expected.keys()):
            problem("extra", f"extra tensor in {fname} (the dst layout does not place it on this rank)", name)
        ok = True
        jobs = []  # (tensor name, its shard, the comparison), in order: problems are reported in this order
        for name, (t, box) in expected.items():
            if name not in keys:
                problem("missing", f"missing from {fname}", name)
                ok = False
                continue
            shape, dtype = tuple(mapped.header[name]["shape"]), mapped.dtype(name)
            spec = man[t]
            if shape != box.sizes:
                problem("shape", f"shape {list(shape)} in {fname}, the dst layout's shard is {list(box.sizes)}", name)
            if dtype != spec.dtype:
                problem("dtype", f"dtype {dtype} in {fname}, the model says {spec.dtype}", name)
            if shape != box.sizes or dtype != spec.dtype:
                ok = False
                continue
            want, threads = _expected_blocks(src, src_l.manifest.index(name), box)
            jobs.append((name, box, workers.submit(threads, _compare, mapped.array(name), want, box, spec.shape,
                                                   block_elems)))
        return _collect(jobs, listed, rr, problem) and ok
    finally:
        workers.wait()  # no job reads the mapping after it is closed, even when one failed
        mapped.close()


def _collect(jobs: list, listed: dict, rr: "RankResult", problem) -> bool:
    """The comparisons' results, in order: differing values, and each shard's checksum against the manifest's.
    Returns whether every checksum matched."""
    ok = True
    for name, box, job in jobs:
        n, first, csum, nbytes = job.result()
        rr.tensors += 1
        rr.bytes += nbytes
        if n:
            local = [g - o for g, o in zip(first, box.offsets)]
            problem("values", f"{n} element{'s' if n != 1 else ''} differ{'s' if n == 1 else ''} from the "
                              f"source, first at {first} (shard index {local})", name,
                    count=n, first_index=first, local_index=local)
        e = listed.get(name) if isinstance(listed.get(name), dict) else None
        if e is None:
            ok = False
        elif e.get("checksum") != rowsum.fmt(csum):
            problem("checksum", f"checksum of the file's shard is {rowsum.fmt(csum)}, the manifest says "
                                f"{e.get('checksum')}", name)
            ok = False
    return ok


def _compare(got_all: np.ndarray, expected, box: Box, shape: tuple, block_elems: int,
             scratch: "_Scratch | None" = None) -> tuple[int, list | None, int, int]:
    """Compare one shard with the source, block by block: (differing elements, first differing global index,
    checksum of the file's shard, bytes compared).

    One pass over the file's shard (`got_all`: its raw bits, a view of the mapped file): each block, seen as rows
    [rows, last dim], is compared with the source's block as int64 words and fed to the checksum
    (`rowsum.RowChecksum`, the same value as `checksums.checksum`). The source's block is a view of the source when
    it has one (`Source.array`), synthetic values generated into scratch (`_SyntheticBlocks`), or `Source.read`
    (`expected`, from `_expected_blocks`)."""
    scratch = scratch or _Scratch()
    count, first, csum, nbytes = 0, None, 0, 0
    # at most _MAX_ROWS rows per block: the per-row arrays (ids, sums, weights) stay small for narrow shards
    limit = min(block_elems, max(1, box.sizes[-1] if box.sizes else 1) * _MAX_ROWS)
    for offs, sizes in blocks(box.sizes, limit):
        sub = Box(tuple(o + a for o, a in zip(box.offsets, offs)), sizes)
        got = got_all[tuple(slice(a, a + s) for a, s in zip(offs, sizes))]
        rows = rowsum.row_ids(sub, shape)
        ncols = sizes[-1] if sizes else 1
        got2 = got.reshape(rows.size, ncols)  # a view: the block is dense in the shard
        want = expected(sub, rows, got2, scratch)
        same = _same_bits(got2, want, scratch)
        if not same:
            diff = got2 != want
            n = int(np.count_nonzero(diff))
            if n:  # only then count and locate the differing elements
                if first is None:
                    pos = int(np.argmax(diff.reshape(-1)))
                    first = [o + v for o, v in zip(sub.offsets, _unravel(pos, sizes))]
                count += n
        cs = rowsum.RowChecksum(sub, shape, got.itemsize, scratch.f64, rows)
        cs.update(0, got2)
        csum += cs.value()
        nbytes += got.nbytes
    return count, first, csum & ((1 << 64) - 1), nbytes


def _address(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


class _Scratch:
    """Buffers reused by every block of one check: the source's block when it must be copied or generated,
    the comparison's booleans and the checksum's float64 steps."""

    def __init__(self):
        self.f64 = rowsum.checksum_buffer()
        self.flags = np.empty(_EQ_CHUNK, dtype=np.bool_)
        self._raw = [np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)]

    def like(self, x: np.ndarray, slot: int = 0) -> np.ndarray:
        """An uninitialised C-contiguous array of `x`'s shape and dtype whose address is `x`'s mod 8 (so the two
        compare as aligned int64 words), in buffer `slot` (0: the source's values, 1: `_same_bits`' copies).
        Valid until the next call for the same slot."""
        nbytes = x.nbytes
        raw = self._raw[slot]
        if raw.size < nbytes + 8:
            raw = self._raw[slot] = np.empty(max(nbytes + 8, 2 * raw.size), dtype=np.uint8)
        shift = (_address(x) - _address(raw)) % 8
        return raw[shift:shift + nbytes].view(x.dtype).reshape(x.shape)


class _Workers:
    """Runs the comparisons of a rank file's shards on a few threads (numpy releases the GIL in its copies,
    comparisons and float64 products), each thread with its own scratch. Jobs that read through a source's own
    code run in the calling thread, in order. At most `MAX` threads: a few per memory channel is enough, and
    each may hold ~150 MiB of scratch."""

    MAX = 8

    def __init__(self, threads: int | None = None):
        if threads is None:
            threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(min(threads, self.MAX)) if threads > 1 else None
        self._pending: list[Future] = []

    def _scratch(self) -> "_Scratch":
        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = _Scratch()
        return s

    def _run(self, fn, args):
        return fn(*args, self._scratch())

    def submit(self, threads: bool, fn, *args) -> Future:
        """`fn(*args, scratch)` on a worker (threads True) or now, in this thread; its result as a future."""
        if threads and self._pool is not None:
            job = self._pool.submit(self._run, fn, args)
            self._pending.append(job)
            return job
        job = Future()
        try:
            job.set_result(self._run(fn, args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever asks for the result
            job.set_exception(e)
        return job

    def wait(self) -> None:
        """Until every job submitted so far has finished (each one's errors stay with its future)."""
        wait(self._pending)
        self._pending.clear()

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


# elements per comparison step: the booleans (256 KiB) stay in cache
_EQ_CHUNK = 1 << 18


def _equal(a: np.ndarray, b: np.ndarray, flags: np.ndarray) -> bool:
    """a == b everywhere (same shape and dtype, 1-D or 2-D), in steps whose booleans stay in cache."""
    if a.ndim == 1:
        a, b = a.reshape(1, -1), b.reshape(1, -1)
    rows, cols = a.shape
    if not a.size:
        return True
    if cols > _EQ_CHUNK:  # wide rows: column steps
        return all(np.equal(a[r, c:c + _EQ_CHUNK], b[r, c:c + _EQ_CHUNK], out=flags[:min(_EQ_CHUNK, cols - c)]).all()
                   for r in range(rows) for c in range(0, cols, _EQ_CHUNK))
    step = max(1, _EQ_CHUNK // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        if not np.equal(a[r:r + n], b[r:r + n], out=flags[:n * cols].reshape(n, cols)).all():
            return False
    return True


def _same_bits(got: np.ndarray, want: np.ndarray, scratch: _Scratch) -> bool:
    """`got` and `want` hold the same bits (both raw-bits arrays of one dtype), fast: compared as int64 words.
    `got` is a C-contiguous block of rows; `want` may be strided (rows of a source view)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.size == 0:
        return True
    if not want.flags.c_contiguous:
        if want.ndim == 2 and want.strides[1] == want.itemsize and want.shape[1] * want.itemsize % 8 == 0 \
                and want.strides[0] % 8 == 0 and (_address(want) - _address(got)) % 8 == 0:
            # strided rows, each a whole number of words aligned like got's: compare them in place
            return _equal(got.view(np.int64), want.view(np.int64), scratch.flags)
        w = scratch.like(got, 1)
        np.copyto(w, want)
        want = w
    a, b = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    n = a.size
    if (_address(a) - _address(b)) % 8:  # not alignable together: compare elements
        return _equal(got.reshape(-1), want.reshape(-1), scratch.flags)
    head = min((-_address(a)) % 8, n)
    end = head + (n - head) // 8 * 8
    return (_equal(a[head:end].view(np.int64), b[head:end].view(np.int64), scratch.flags)
            and (not head or bool((a[:head] == b[:head]).all())) and (end == n or bool((a[end:] == b[end:]).all())))


def _expected_blocks(src: Source, t: int, box: Box):
    """The source's values of `box`'s blocks, as raw bits: (a function (block, its global row ids, the file's
    block as rows, scratch) -> the source's block as rows [rows, last dim], whether that function may run on
    worker threads). From a view of the source or synthetic values generated into scratch (numpy only: any
    thread), or `src.read` of the block (the source's own code, torch for most: the calling thread)."""
    spec = src.manifest.tensors[t]
    inside = len(box.sizes) == len(spec.shape) and all(
        0 <= o and o + s <= n for o, s, n in zip(box.offsets, box.sizes, spec.shape))
    if inside and not box.empty:  # else `read` raises the source's own error
        if isinstance(src, SyntheticSource):
            fast = _SyntheticBlocks.make(t, spec.shape, spec.dtype, src.seed)
            if fast is not None:
                return fast.block, True
        full = src.array(t)
        if full is not None:
            return (lambda sub, rows, like, scratch: _as_rows(full[sub.slices()], rows.size)), True
    return (lambda sub, rows, like, scratch: _as_rows(_bits(src.read(t, sub)), rows.size)), False


def _bits(x) -> np.ndarray:
    """A torch tensor's raw bits as a numpy array (for sources read through torch)."""
    from reshard_cli.base.checksums import numpy_bits

    return numpy_bits(x)


def _as_rows(block: np.ndarray, nrows: int) -> np.ndarray:
    """`block` as [rows, last dim]: a view unless its dims do not merge (a strided view of the source)."""
    return block.reshape(nrows, -1) if block.ndim else block.reshape(1, 1)


class _SyntheticBlocks:
    """`synthetic_values` of blocks of one tensor as raw bits, copied by `synthetic.synthetic_fill` (the code
    `SyntheticSource.read` runs, numpy only) into scratch aligned like the file's block: each span of 2^20
    elements is the dtype's period of values (`synthetic.synthetic_period`, built once) read from the span's own
    rotation, so the values do not repeat at any period a misrouted element could hide in, and producing them
    costs a copy."""

    def __init__(self, period: np.ndarray, key: int, width: int):
        self.period, self.key, self.width = period, key, width

    @staticmethod
    def make(t: int, shape: tuple, dtype: str, seed: int) -> "_SyntheticBlocks | None":
        """For tensor `t` of `shape` and torch dtype name `dtype` (None: a dtype without a table; `read` it)."""
        if synthetic_table(dtype) is None:
            return None
        return _SyntheticBlocks(synthetic_period(dtype), synthetic_key(t, seed), shape[-1] if shape else 1)

    def block(self, sub: Box, rows: np.ndarray, like: np.ndarray, scratch: _Scratch) -> np.ndarray:
        """The values of block `sub` (global row ids `rows`) as rows [rows, last dim], in scratch aligned like
        `like` (the file's block) when it has their shape and type."""
        ncols, col0 = (sub.sizes[-1], sub.offsets[-1]) if sub.sizes else (1, 0)
        shape = (rows.size, ncols)
        out = scratch.like(like) if like.dtype == self.period.dtype and tuple(like.shape) == shape \
            else np.empty(shape, dtype=self.period.dtype)
        return synthetic_fill(out, rows * self.width + col0, self.key, self.period)


__all__ = ["BLOCK_ELEMS", "Problem", "RankResult", "CheckResult", "blocks", "check_output"]
