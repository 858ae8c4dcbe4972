"""`reshard check`: prove an output directory (`reshard run --out`) against its source, without torchrun.

For every destination rank of the dst layout and every tensor that rank holds, the shard in
`rank-NNNNN.safetensors` must be exactly the slice of the source tensor that the dst layout places there
(raw bytes, element by element), and the manifest's checksum must be the checksum of the file's shard.
The manifest itself must describe the layouts given: every dst rank present, the rank numbers, shapes,
offsets and dtypes the dst layout says.

Memory stays bounded: one block of one shard at a time (at most `BLOCK_ELEMS` elements, split along the
first dims so that a block is a dense sub-box), read with `safe_open(...).get_slice` and compared with the
same block read from the source.
"""
from __future__ import annotations

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
from reshard_cli.io.sources import Source, open_source

# Elements per block (1 Mi): the file's block, the source's block and the float64 temporaries of the
# checksum (8 MiB) stay far under 256 MiB at any tensor size, with few enough blocks to keep overhead low.
BLOCK_ELEMS = 1 << 20

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
        for i, grank in enumerate(dst_layout.ranks):
            _check_rank(i, grank, entries.get(i), out, src, src_layout, dst_layout, result, block_elems)
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
                result: CheckResult, block_elems: int) -> None:
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
            n, first, csum, nbytes = _compare(sl, src, src_l.manifest.index(name), box, spec.shape, block_elems)
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
    rr.checksum_ok = checksums_ok if entry is not None else None
    rr.mismatches = len(result.problems) - before


def _compare(sl, src: Source, t_src: int, box: Box, shape: tuple, block_elems: int
             ) -> tuple[int, list | None, int, int]:
    """Compare one shard with the source, block by block: (differing elements, first differing global index,
    checksum of the file's shard, bytes compared)."""
    count, first, csum, nbytes = 0, None, 0, 0
    for offs, sizes in blocks(box.sizes, block_elems):
        sub = Box(tuple(o + a for o, a in zip(box.offsets, offs)), sizes)
        got = sl[tuple(slice(a, a + s) for a, s in zip(offs, sizes))]
        want = src.read(t_src, sub)
        diff = verify.differing(got, want)
        if diff is not None:  # only then count and locate the differing elements
            n = int(diff.sum())
            if first is None:
                pos = int(torch.argmax(diff.to(torch.uint8)))
                first = [o + v for o, v in zip(sub.offsets, _unravel(pos, sizes))]
            count += n
        csum += verify.checksum(got, sub, shape)
        nbytes += got.numel() * got.element_size()
    return count, first, csum & ((1 << 64) - 1), nbytes


__all__ = ["BLOCK_ELEMS", "Problem", "RankResult", "CheckResult", "blocks", "check_output"]
