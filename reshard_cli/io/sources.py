"""Where a trainer rank's weights come from: synthetic values, safetensors, a shard directory, or a DCP checkpoint.

Every source answers `read(t, box)`: a tensor of shape `box.sizes` and the manifest dtype holding global region
`box` of manifest tensor `t`, read lazily (only that region, or at worst the stored chunks that overlap it).
`check(layout, rank)` runs before any transfer and names the file and the tensor when something does not match.

    spec                               source
    None | "synthetic" | "synthetic:3" SyntheticSource (seed 0 / 3)
    "safetensors:ckpt/"                SafetensorsSource (a file, a directory, or an index.json)
    "shards:out/"                      ShardsSource (a directory written by reshard_cli.io.sinks)
    "dcp:ckpt_dcp/"                    DcpSource (torch.distributed.checkpoint, FileSystemWriter format)
    "megatron:ckpt/iter_0000100/"      MegatronDistSource (Megatron-core torch_dist, read in checkpoint space)
    {kind: ..., path: ... | seed: ...} the same, from the src layout's `source:` key
"""
from __future__ import annotations

import functools
import math
import pickle
import re
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from reshard_cli.errors import ConfigError, ReshardError, RuntimeFailure
from reshard_cli.base.geometry import Box
from reshard_cli.formats import megatron
from reshard_cli.io.synthetic import synthetic_values
from reshard_cli.layouts.layout import Layout
from reshard_cli.layouts.models import _SAFETENSORS_DTYPES, Manifest, read_safetensors_header, read_safetensors_index
from reshard_cli.layouts.yamlio import check_keys, line_of

if TYPE_CHECKING:  # torch is imported where a source or sink needs it: `reshard check` starts without it
    import numpy as np
    import torch

KINDS = ("synthetic", "safetensors", "shards", "dcp", "megatron")
_KEYS = {"synthetic": ("kind", "seed"), "safetensors": ("kind", "path"), "shards": ("kind", "path"),
         "dcp": ("kind", "path"), "megatron": ("kind", "path")}


def _torch_dtype(name: str) -> torch.dtype:
    import torch
    return getattr(torch, name)


def _mismatch(name: str, what: str, got: Any, want: Any) -> str:
    return f"tensor {name!r} has {what} {got}, layout expects {want}"


def _expect(spec, shape: tuple, dtype: str, file: str) -> None:
    """A source's tensor must have the layout's shape and dtype; else a one-line error naming `file`."""
    if tuple(shape) != spec.shape:
        raise ConfigError(_mismatch(spec.name, "shape", list(shape), list(spec.shape)), file=file)
    if dtype != spec.dtype:
        raise ConfigError(_mismatch(spec.name, "dtype", dtype, spec.dtype), file=file)


# ----------------------------------------------------------------------------------------------- base


class Source:
    """Base class: where a source rank's tensors come from."""

    kind: str = ""
    description: str = ""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest

    def check(self, layout: Layout, rank: int) -> None:
        """Raise ConfigError (naming file and tensor) unless every tensor `rank` holds exists as the manifest says."""
        for t, _box in layout.held(rank):
            spec = layout.manifest.tensors[t]
            found = self._stored(spec)
            if found is not None:
                _expect(spec, *found)

    def _stored(self, spec) -> tuple[tuple, str, str] | None:
        """(shape, dtype, file to name in errors) of `spec`'s tensor as stored; ConfigError if it is missing.
        None: nothing is stored (synthetic values)."""
        return None

    def read(self, t: int, box: Box) -> torch.Tensor:
        raise NotImplementedError

    def read_many(self, requests: Sequence[tuple[int, Box]]) -> list[torch.Tensor]:
        """`read` for several (tensor, box) pairs; sources that can batch override this."""
        return [self.read(t, box) for t, box in requests]

    def array(self, t: int) -> "np.ndarray | None":
        """The whole tensor `t`'s raw bits as a numpy array without copying it (a view of a memory-mapped file,
        one signed integer of the element's size per element: `rowsum.bits_dtype`; do not write to it), or None
        when this source cannot give one: then `read` boxes."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spec(self, t: int):
        return self.manifest.tensors[t]

    def _empty(self, t: int, box: Box) -> torch.Tensor:
        import torch
        return torch.empty(box.sizes, dtype=_torch_dtype(self._spec(t).dtype))

    def _check_box(self, t: int, box: Box) -> None:
        shape = self._spec(t).shape
        if len(box.sizes) != len(shape) or any(o < 0 or s < 0 or o + s > n
                                               for o, s, n in zip(box.offsets, box.sizes, shape)):
            raise RuntimeFailure(f"box {box} is outside tensor {self._spec(t).name!r} of shape {list(shape)}")


class SyntheticSource(Source):
    """Values computed from (tensor index, global index, seed): no files, and every rank knows every value."""

    kind = "synthetic"

    def __init__(self, manifest: Manifest, seed: int = 0):
        super().__init__(manifest)
        self.seed = seed
        self.description = f"synthetic (seed {seed})"

    def expected(self, t: int, box: Box) -> torch.Tensor:
        spec = self._spec(t)
        return synthetic_values(t, box, spec.shape, _torch_dtype(spec.dtype), self.seed)

    def read(self, t: int, box: Box) -> torch.Tensor:
        self._check_box(t, box)
        return self.expected(t, box)


# ----------------------------------------------------------------------------------------------- safetensors


class _Handles:
    """Lazily opened, reused `safe_open` handles, one per file."""

    def __init__(self):
        self._open: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def get(self, path: Path):
        with self._lock:
            h = self._open.get(path)
            if h is None:
                from safetensors import safe_open
                try:
                    h = self._open[path] = safe_open(str(path), framework="pt")
                except FileNotFoundError:
                    raise ConfigError("file not found", file=str(path)) from None
                except Exception as e:  # safetensors raises its own error types for corrupt files
                    raise ConfigError(f"cannot open safetensors file: {e}", file=str(path)) from None
            return h

    def close(self) -> None:
        with self._lock:
            for h in self._open.values():
                try:
                    h.__exit__(None, None, None)
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
            self._open.clear()


def _read_slice(handles: _Handles, file: Path, name: str, slices: tuple, sizes: tuple, dtype: torch.dtype,
                what: str) -> torch.Tensor:
    """Region `slices` of tensor `name` in safetensors `file` (only those bytes are read)."""
    try:
        x = handles.get(file).get_slice(name)[slices]
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise RuntimeFailure(f"{file}: reading {what} of tensor {name!r} failed: {e}") from None
    if tuple(x.shape) != tuple(sizes) or x.dtype != dtype:
        raise RuntimeFailure(f"{file}: tensor {name!r} {what} read as {list(x.shape)} {x.dtype}, "
                             f"expected {list(sizes)} {dtype}")
    return x


def _cached_header(cache: dict, f: Path, missing: str) -> dict:
    """The tensor entries of safetensors file `f`'s header, read once (no tensor data)."""
    h = cache.get(f)
    if h is None:
        if not f.is_file():
            raise ConfigError(missing, file=str(f))
        h = cache[f] = read_safetensors_header(f)[0]
    return h


class SafetensorsSource(Source):
    """A safetensors file, a directory of `*.safetensors` (with or without `model.safetensors.index.json`),
    or an index.json. Boxes are read with `get_slice`, so only the requested bytes leave the file."""

    kind = "safetensors"

    def __init__(self, manifest: Manifest, path: Path, shown: str | None = None):
        super().__init__(manifest)
        self.path = Path(path)
        shown = shown or str(path)
        self._where = str(self.path)  # names the checkpoint in "tensor is missing" errors
        self._headers: dict[Path, dict] = {}
        self._file_of: dict[str, Path] = {}
        if self.path.is_dir():
            index = self.path / "model.safetensors.index.json"
            if index.is_file():
                files = self._load_index(index)
            else:
                files = sorted(self.path.glob("*.safetensors"))
                if not files:
                    raise ConfigError("no *.safetensors files in directory", file=str(self.path))
                for f in files:
                    for name in self._header(f):
                        self._file_of.setdefault(name, f)
        elif self.path.name.endswith(".json"):
            if not self.path.is_file():
                raise ConfigError("file not found", file=str(self.path))
            files = self._load_index(self.path)
        else:
            if not self.path.is_file():
                raise ConfigError("file not found", file=str(self.path))
            files = [self.path]
            for name in self._header(self.path):
                self._file_of[name] = self.path
        self.files = files
        self.description = f"safetensors {shown} ({len(files)} file{'s' if len(files) != 1 else ''})"
        self._handles = _Handles()
        self._maps: dict[Path, Any] = {}  # file -> MappedSafetensors, for `array`

    def _load_index(self, index: Path) -> list[Path]:
        self._file_of.update(read_safetensors_index(index))
        self._where = str(index)
        return list(dict.fromkeys(self._file_of.values()))

    def _stored(self, spec) -> tuple[tuple, str, str]:
        """(shape, dtype, file) of `spec` as its checkpoint file's header stores it."""
        f = self._file_of.get(spec.name)
        if f is None:
            raise ConfigError(f"tensor {spec.name!r} is missing", file=self._where)
        entry = self._header(f).get(spec.name)
        if entry is None:
            raise ConfigError(f"tensor {spec.name!r} is missing (the index names this file)", file=str(f))
        return tuple(entry["shape"]), _SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"]), str(f)

    def _header(self, f: Path) -> dict:
        return _cached_header(self._headers, f, "file not found")

    def read(self, t: int, box: Box) -> torch.Tensor:
        self._check_box(t, box)
        spec = self._spec(t)
        if box.empty:
            return self._empty(t, box)
        f = self._file_of.get(spec.name)
        if f is None:
            raise ConfigError(f"tensor {spec.name!r} is missing", file=self._where)
        return _read_slice(self._handles, f, spec.name, box.slices(), box.sizes, _torch_dtype(spec.dtype), str(box))

    def array(self, t: int) -> "np.ndarray | None":
        """Tensor `t`'s raw bits as a view of its file mapped into memory (`io.mapped`); None when it is not stored
        with the manifest's shape and dtype (then `read` says what is wrong)."""
        from reshard_cli.io.mapped import MappedSafetensors
        spec = self._spec(t)
        f = self._file_of.get(spec.name)
        if f is None:
            return None
        if f not in self._maps:
            try:
                self._maps[f] = MappedSafetensors(f)
            except (ConfigError, OSError, ValueError):
                self._maps[f] = None
        m = self._maps[f]
        if m is None or m.dtype(spec.name) != spec.dtype:
            return None
        x = m.array(spec.name)
        return x if x is not None and tuple(x.shape) == spec.shape else None

    def close(self) -> None:
        self._handles.close()
        for m in self._maps.values():
            if m is not None:
                m.close()
        self._maps.clear()


# ----------------------------------------------------------------------------------------------- shards


class ShardsSource(Source):
    """A directory written by `reshard_cli.io.sinks`: `manifest.json` + one safetensors file per destination rank.

    A box is assembled from the intersections with the shards that overlap it, ranks in manifest order; a part
    already filled (by an earlier replica) is not read again.
    """

    kind = "shards"

    def __init__(self, manifest: Manifest, path: Path, shown: str | None = None):
        from reshard_cli.io import sinks
        super().__init__(manifest)
        self.path = Path(path)
        self.doc = sinks.read_manifest(self.path)
        self._mfile = str(self.path / sinks.MANIFEST_NAME)
        # tensor name -> (global shape, dtype, [(rank index, file, shard box), ...] in rank order)
        self._index: dict[str, tuple[tuple, str, list[tuple[int, Path, Box]]]] = {}
        ranks = self.doc.get("ranks")
        if not isinstance(ranks, list):
            raise ConfigError("expected a list", file=self._mfile, key="ranks")
        for i, r in enumerate(ranks):
            self._add_rank(i, r)
        self.description = f"shards {shown or path} ({len(ranks)} rank file{'s' if len(ranks) != 1 else ''})"
        self._handles = _Handles()
        self._rank_headers: dict[Path, dict] = {}

    def _add_rank(self, i: int, r: Any) -> None:
        where = f"ranks[{i}]"
        if not isinstance(r, dict) or not isinstance(r.get("tensors"), dict) or not isinstance(r.get("file"), str):
            raise ConfigError("expected {index, rank, file, tensors}", file=self._mfile, key=where)
        fname = r["file"]
        if Path(fname).name != fname or fname in ("", ".", ".."):
            raise ConfigError(f"expected a plain file name, got {fname!r}", file=self._mfile, key=f"{where}.file")
        idx = r.get("index", i)
        f = self.path / fname
        for name, e in r["tensors"].items():
            key = f"{where}.tensors.{name}"
            ok = (isinstance(e, dict) and all(_int_list(e.get(k)) for k in ("shape", "offsets", "local_shape"))
                  and isinstance(e.get("dtype"), str)
                  and len(e["shape"]) == len(e["offsets"]) == len(e["local_shape"])
                  and all(0 <= o and o + s <= n or s == 0
                          for o, s, n in zip(e["offsets"], e["local_shape"], e["shape"])))
            if not ok:
                raise ConfigError("expected {shape, offsets, local_shape, dtype} with the shard inside the tensor",
                                  file=self._mfile, key=key)
            shape = tuple(e["shape"])
            entry = self._index.setdefault(name, (shape, e["dtype"], []))
            if entry[0] != shape or entry[1] != e["dtype"]:
                raise ConfigError(f"shape/dtype {list(shape)} {e['dtype']} differ from an earlier rank's "
                                  f"{list(entry[0])} {entry[1]}", file=self._mfile, key=key)
            entry[2].append((idx, f, Box(tuple(e["offsets"]), tuple(e["local_shape"]))))

    def _rank_header(self, f: Path) -> dict:
        return _cached_header(self._rank_headers, f, "rank file is missing")

    def _stored(self, spec) -> tuple[tuple, str, str]:
        """The manifest's entry, and every rank file's shard of it checked against the manifest."""
        entry = self._index.get(spec.name)
        if entry is None:
            raise ConfigError(f"tensor {spec.name!r} is missing", file=self._mfile)
        shape, dtype, shards = entry
        _expect(spec, shape, dtype, self._mfile)
        # the shards: they tile the tensor, and each file holds what the manifest says
        unique = {b for _, _, b in shards if not b.empty}
        covered = sum(b.numel for b in unique)
        if covered != math.prod(shape):  # distinct shards of a complete tensor tile it exactly
            raise ConfigError(f"the shards of tensor {spec.name!r} do not tile it: they hold {covered} "
                              f"elements, the tensor has {math.prod(shape)}", file=self._mfile)
        for _, f, b in shards:
            h = self._rank_header(f).get(spec.name)
            if h is None:
                raise ConfigError(f"tensor {spec.name!r} is missing", file=str(f))
            got_dtype = _SAFETENSORS_DTYPES.get(h["dtype"], h["dtype"])
            if tuple(h["shape"]) != b.sizes or got_dtype != dtype:
                raise ConfigError(f"tensor {spec.name!r} is {list(h['shape'])} {got_dtype}, manifest says "
                                  f"{list(b.sizes)} {dtype}", file=str(f))
        return shape, dtype, self._mfile

    def read(self, t: int, box: Box) -> torch.Tensor:
        import torch
        self._check_box(t, box)
        spec = self._spec(t)
        dtype = _torch_dtype(spec.dtype)
        out = torch.empty(box.sizes, dtype=dtype)
        if box.empty:
            return out
        entry = self._index.get(spec.name)
        if entry is None:
            raise ConfigError(f"tensor {spec.name!r} is missing", file=self._mfile)
        filled = torch.zeros(box.sizes, dtype=torch.bool)
        left = box.numel
        for _, f, shard in entry[2]:
            if not left:
                break
            part = shard.intersect(box)
            if part is None:
                continue
            dst = part.local_slices(box)
            done = filled[dst]
            if bool(done.all()):
                continue  # a replica of a part already read
            if not f.is_file():
                raise ConfigError("rank file is missing", file=str(f))
            x = _read_slice(self._handles, f, spec.name, part.local_slices(shard), part.sizes, dtype,
                            f"{part} (shard {shard})")
            if bool(done.any()):  # partial overlap with what is filled: only take the new elements
                todo = ~done
                out[dst][todo] = x[todo]
                left -= int(todo.sum())
            else:
                out[dst] = x
                left -= part.numel
            filled[dst] = True
        if left:
            raise RuntimeFailure(f"{self._mfile}: the shards of tensor {spec.name!r} leave {left} elements of box "
                                 f"{box} uncovered")
        return out

    def close(self) -> None:
        self._handles.close()


def _int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


# ----------------------------------------------------------------------------------------------- DCP


# What DCP's `.metadata` pickle may name. It is unpickled with this allow-list only: a checkpoint directory
# is data, and a crafted `.metadata` must not run code. Chunk data is read by DCP itself with
# `torch.load(weights_only=True)`.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint._extension", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.storage")
_SAFE_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                 ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                 ("pathlib", "PureWindowsPath"), ("pathlib", "Path"), ("builtins", "set"),
                 ("builtins", "frozenset"), ("builtins", "slice")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch
        obj = None
        if (module, name) in _SAFE_GLOBALS:
            obj = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            obj = getattr(torch, name)
        elif module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if not isinstance(obj, type):  # classes (dataclasses, enums) only, no functions
                obj = None
        if obj is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return obj


def _read_dcp_metadata(path: Path):
    from torch.distributed.checkpoint.metadata import Metadata
    mfile = path / ".metadata"
    if not path.is_dir():
        raise ConfigError("not a directory (expected a torch.distributed.checkpoint directory)", file=str(path))
    if not mfile.is_file():
        raise ConfigError("no .metadata file: not a torch.distributed.checkpoint directory", file=str(mfile))
    try:
        with open(mfile, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except Exception as e:  # noqa: BLE001 - any failure means an unreadable checkpoint
        raise ConfigError(f"cannot read DCP metadata: {e.__class__.__name__}: {e}", file=str(mfile)) from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise ConfigError("not DCP metadata", file=str(mfile))
    return md


class DcpSource(Source):
    """A torch.distributed.checkpoint directory (FileSystemWriter format), read without a process group.

    `read_many` runs one `dcp.load(no_dist=True)` with a planner whose plan holds ReadItems for the requested
    boxes only: DCP's resharding helper (`create_read_items_for_chunk_list`) intersects each box with the
    stored chunks, and each ReadItem copies exactly that intersection into a view of the output tensor. The
    storage layer (FileSystemReader) deserializes each overlapping stored chunk whole (its file format is one
    `torch.save` record per chunk, with no way to read part of it) and then narrows it; chunks that do not
    overlap the box are never touched. So: exact boxes, chunk-level I/O — a checkpoint saved from plain
    tensors has one chunk per tensor, a sharded (DTensor) one a chunk per saved shard.
    """

    kind = "dcp"

    def __init__(self, manifest: Manifest, path: Path, shown: str | None = None):
        super().__init__(manifest)
        self.path = Path(path)
        self.metadata = _read_dcp_metadata(self.path)
        self._mfile = str(self.path / ".metadata")
        sd = self.metadata.state_dict_metadata
        files = {getattr(info, "relative_path", None) for info in (self.metadata.storage_data or {}).values()}
        plural = "s" if len(files) != 1 else ""
        self.description = f"dcp {shown or path} ({len(sd)} entries, {len(files)} file{plural})"

    def _tensor_md(self, name: str):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        md = self.metadata.state_dict_metadata.get(name)
        if md is None:
            raise ConfigError(f"tensor {name!r} is missing", file=str(self.path))
        if not isinstance(md, TensorStorageMetadata):
            raise ConfigError(f"entry {name!r} is not a tensor ({type(md).__name__})", file=self._mfile)
        return md

    def _stored(self, spec) -> tuple[tuple, str, str]:
        md = self._tensor_md(spec.name)
        return tuple(md.size), str(md.properties.dtype).removeprefix("torch."), self._mfile

    def read(self, t: int, box: Box) -> torch.Tensor:
        return self.read_many([(t, box)])[0]

    def read_many(self, requests: Sequence[tuple[int, Box]]) -> list[torch.Tensor]:
        import torch
        outs: list[torch.Tensor] = []
        pieces = []
        for t, box in requests:
            self._check_box(t, box)
            spec = self._spec(t)
            out = self._empty(t, box)
            outs.append(out)
            if box.empty:
                continue
            md = self._tensor_md(spec.name)
            if tuple(md.size) != spec.shape:
                raise ConfigError(_mismatch(spec.name, "shape", list(md.size), list(spec.shape)), file=self._mfile)
            pieces.append((spec.name, md, box.offsets, box.sizes, out))
        self._load(pieces)
        return outs

    def _load(self, pieces) -> None:
        """One `dcp.load` that fills each piece (key, its metadata, offsets, sizes, output view) from the
        stored chunks overlapping that region of the key's global tensor."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        items, outs = [], []
        for key, md, offsets, sizes, out in pieces:
            want = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            mine = create_read_items_for_chunk_list(key, md, [want])
            # The destination index carries the piece number, so regions of one key stay apart.
            mine = [_replace_dest(ri, MetadataIndex(key, torch.Size(offsets), len(outs))) for ri in mine]
            regions = {(tuple(ri.dest_offsets), tuple(ri.lengths)) for ri in mine}
            got = sum(math.prod(n) for _, n in regions)
            if got != math.prod(sizes):
                raise RuntimeFailure(f"{self._mfile}: the stored chunks of {key!r} cover {got} of the "
                                     f"{math.prod(sizes)} elements at offsets {list(offsets)}")
            items.extend(mine)
            outs.append(out)
        if items:
            planner_cls, reader_cls = _dcp_classes()
            planner = planner_cls(items, outs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": intended
                try:
                    dcp.load({}, storage_reader=reader_cls(self.path, self.metadata), planner=planner,
                             no_dist=True)
                except ReshardError:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise RuntimeFailure(f"{self.path}: DCP read failed: {e.__class__.__name__}: {e}") from None


class MegatronDistSource(DcpSource):
    """A Megatron-core distributed checkpoint (`torch_dist`: torch.distributed.checkpoint under Megatron's
    sharded-state-dict keys), read in checkpoint (HF) space: `formats.megatron.global_views` says where each
    HF box lies (q/k/v interleaved per query group in `linear_qkv`, [gate; up] in `linear_fc1`, experts and
    layers as leading axes, the padded vocabulary), and each box is read from the stored chunks that overlap
    it, like any DCP source: a rank reads only what it holds. `common.pt` (pickled) is never opened."""

    kind = "megatron"

    def __init__(self, manifest: Manifest, path: Path, shown: str | None = None):
        import json

        super().__init__(manifest, path, shown)
        meta = self.path / "metadata.json"
        try:
            backend = json.loads(meta.read_text()).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            raise ConfigError("no readable metadata.json: not a Megatron distributed checkpoint",
                              file=str(meta)) from None
        if backend != "torch_dist":
            raise ConfigError(f"sharded_backend is {backend!r}; reshard reads torch_dist checkpoints", file=str(meta))
        keys = self.metadata.state_dict_metadata
        per_layer = any(re.match(r"decoder\.layers\.\d+\.", k) for k in keys)
        self.views = megatron.global_views(manifest, per_layer=per_layer)
        self.description = self.description.replace("dcp ", "megatron torch_dist ", 1)

    def check(self, layout: Layout, rank: int) -> None:
        import torch
        vocab = re.compile(megatron.VOCAB)
        for t, _box in layout.held(rank):
            spec = layout.manifest.tensors[t]
            for cv in self.views.get(t, ()):
                if cv.key not in self.metadata.state_dict_metadata:
                    raise ConfigError(f"the checkpoint has no key {cv.key!r} (where Megatron keeps {spec.name}): "
                                      f"a checkpoint of another model?", file=str(self.path))
                md = self._tensor_md(cv.key)
                size, dtype = tuple(md.size), str(md.properties.dtype).removeprefix("torch.")
                padded = vocab.search(spec.name) and len(size) == len(cv.shape) and size[0] >= cv.shape[0]
                if size != cv.shape and not (padded and size[1:] == cv.shape[1:]):
                    raise ConfigError(f"{cv.key} is {list(size)}, model {self.manifest.name!r} makes it "
                                      f"{list(cv.shape)} (for {spec.name})", file=self._mfile)
                floats = getattr(torch, dtype).is_floating_point and getattr(torch, spec.dtype).is_floating_point
                if dtype != spec.dtype and not floats:  # fp32 norms of a bf16 model are cast as they are read
                    raise ConfigError(f"{cv.key} is {dtype}, the layout expects {spec.dtype} (for {spec.name})",
                                      file=self._mfile)
            if t not in self.views:
                raise ConfigError(f"no Megatron key holds {spec.name!r}", file=self._mfile)

    def read_many(self, requests: Sequence[tuple[int, Box]]) -> list[torch.Tensor]:
        import torch
        outs: list[torch.Tensor] = []
        pieces = []
        for t, box in requests:
            self._check_box(t, box)
            out = self._empty(t, box)
            outs.append(out)
            for cv in self.views.get(t, ()):
                common = box.intersect(cv.box)
                if common is None or common.empty:
                    continue
                lead = len(cv.offsets) - len(cv.box.offsets)
                offsets = cv.offsets[:lead] + tuple(o + c - b for o, c, b in
                                                     zip(cv.offsets[lead:], common.offsets, cv.box.offsets))
                view = out[common.local_slices(box)]
                for _ in range(lead):
                    view = view.unsqueeze(0)
                pieces.append((cv.key, self._tensor_md(cv.key), offsets, (1,) * lead + common.sizes, view))
        self._load(pieces)
        return outs


def _replace_dest(ri, dest_index):
    from dataclasses import replace
    return replace(ri, dest_index=dest_index)


@functools.cache
def _dcp_classes():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

    class BoxLoadPlanner(LoadPlanner):
        """A LoadPlanner whose plan is a fixed list of ReadItems; each writes into a view of `outs[index]`."""

        def __init__(self, items, outs):
            self.items, self.outs = items, outs

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            self.metadata = metadata

        def create_local_plan(self):
            return LoadPlan(list(self.items))

        def create_global_plan(self, global_plan):
            return global_plan

        def finish_plan(self, central_plan):
            return central_plan

        def load_bytes(self, read_item, value) -> None:
            raise RuntimeFailure(f"unexpected non-tensor entry {read_item.dest_index.fqn!r}")

        def resolve_tensor(self, read_item):
            out = self.outs[read_item.dest_index.index]
            for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                out = out.narrow(d, o, n)
            return out

        def commit_tensor(self, read_item, tensor) -> None:
            pass  # resolve_tensor handed out a view of the output: the data is already in place

    class CachedReader(FileSystemReader):
        """FileSystemReader that reuses metadata read once (by the allow-list unpickler)."""

        def __init__(self, path, metadata):
            super().__init__(str(path))
            self._md = metadata

        def read_metadata(self, *args, **kwargs):
            return self._md

    return BoxLoadPlanner, CachedReader


# ----------------------------------------------------------------------------------------------- open_source


def open_source(spec: Any, layout: Layout, *, base_dir: Path | None = None) -> Source:
    """The source described by `spec` (None, "synthetic[:SEED]", "KIND:PATH", or a `source:` mapping).

    Relative paths resolve against `base_dir`; when it is None, a mapping's paths resolve against the layout
    file's directory and a string's against the current directory.
    """
    manifest = layout.manifest
    if spec is None:
        return SyntheticSource(manifest, 0)
    if isinstance(spec, str):
        kind, sep, arg = spec.partition(":")
        kind = kind.strip().lower()
        if kind == "synthetic":
            try:
                seed = int(arg) if sep else 0
            except ValueError:
                raise ConfigError(f"expected synthetic or synthetic:SEED (an integer), got {spec!r}",
                                  key="source") from None
            return SyntheticSource(manifest, seed)
        if kind not in KINDS or not sep or not arg:
            raise ConfigError(f"expected synthetic or KIND:PATH with KIND one of {', '.join(KINDS[1:])}, "
                              f"got {spec!r}", key="source")
        path = Path(arg) if base_dir is None else Path(base_dir) / arg
        return _open_path(kind, path, arg, manifest, file=None, key="source")

    file = layout.file
    if not isinstance(spec, dict):
        raise ConfigError(f"expected a mapping like {{kind: safetensors, path: ckpt/}} or a string, got "
                          f"{type(spec).__name__}", file=file, key="source", line=getattr(spec, "line", None))
    kind = spec.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"unknown source kind {kind!r} (kinds: {', '.join(KINDS)})", file=file,
                          key="source.kind", line=line_of(spec, "kind"))
    required = ("kind", "path") if kind != "synthetic" else ("kind",)
    check_keys(spec, _KEYS[kind], file=file, where="source", required=required)
    if kind == "synthetic":
        seed = spec.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError("expected an integer", file=file, key="source.seed", line=line_of(spec, "seed"))
        return SyntheticSource(manifest, seed)
    raw = spec["path"]
    if not isinstance(raw, str) or not raw:
        raise ConfigError("expected a path", file=file, key="source.path", line=line_of(spec, "path"))
    base = Path(base_dir) if base_dir is not None else Path(file).parent
    return _open_path(kind, base / raw, raw, manifest, file=file, key="source.path", line=line_of(spec, "path"))


def _open_path(kind: str, path: Path, shown: str, manifest: Manifest, *, file: str | None, key: str,
               line: int | None = None) -> Source:
    if not path.exists():
        raise ConfigError(f"{kind} source not found: {path}", file=file, key=key, line=line)
    if kind == "safetensors":
        return SafetensorsSource(manifest, path, shown)
    if kind == "shards":
        return ShardsSource(manifest, path, shown)
    if kind == "megatron":
        return MegatronDistSource(manifest, path, shown)
    return DcpSource(manifest, path, shown)


__all__ = ["KINDS", "Source", "SyntheticSource", "SafetensorsSource", "ShardsSource", "DcpSource",
           "MegatronDistSource", "open_source"]
