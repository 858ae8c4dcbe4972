"""Where a destination rank's shards go: one safetensors file per destination rank plus a `manifest.json`.

    out/
      rank-00000.safetensors   # the shards dst rank index 0 holds, under their global tensor names
      rank-00001.safetensors
      manifest.json            # written last, only when everything verified: format, layouts, and per rank
                               # {file, tensors: {name: {shape, offsets, local_shape, dtype, checksum}}}

Every file is written under a temporary name and renamed into place, so a final name never holds a
half-written file. `reshard_cli.io.sources.ShardsSource` reads such a directory back.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard_cli.errors import ConfigError
from reshard_cli.base.files import atomic_write, atomic_write_text
from reshard_cli.layouts.layout import Layout

if TYPE_CHECKING:  # torch is imported where a source or sink needs it: `reshard check` starts without it
    import torch

FORMAT = "reshard-shards/1"
MANIFEST_NAME = "manifest.json"
_RANK_FILE_RE = re.compile(r"rank-\d{5,}\.safetensors")


def rank_file_name(index: int) -> str:
    """File of the dst rank with this index within the dst group: rank-00000.safetensors."""
    return f"rank-{index:05d}.safetensors"


def _ours(name: str) -> bool:
    return name == MANIFEST_NAME or bool(_RANK_FILE_RE.fullmatch(name)) or name.endswith(".tmp")


def prepare_out_dir(out: Path, *, overwrite: bool) -> None:
    """Create `out` if missing. A non-empty one is refused unless `overwrite`, which removes only our own files
    (manifest.json first, then rank-*.safetensors and *.tmp) and refuses when anything else is there."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError("output path exists and is not a directory", file=str(out))
    if not out.exists():
        try:
            out.mkdir(parents=True)
        except OSError as e:
            raise ConfigError(f"cannot create output directory: {e.strerror or e}", file=str(out)) from None
        return
    entries = sorted(out.iterdir())
    if not entries:
        return
    if not overwrite:
        raise ConfigError("output directory is not empty (use --overwrite)", file=str(out))
    foreign = [p for p in entries if not (_ours(p.name) and (p.is_file() or p.is_symlink()))]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ConfigError(f"output directory holds files reshard did not write ({foreign[0].name}{more}); "
                          f"refusing to overwrite", file=str(out))
    # the manifest goes first: a directory without it never looks like a complete output
    for p in sorted(entries, key=lambda p: p.name != MANIFEST_NAME):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ConfigError(f"cannot remove {p.name}: {e.strerror or e}", file=str(out)) from None


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, with no two sharing storage (safetensors refuses shared storage)."""
    import torch
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, x in tensors.items():
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.contiguous()
        if x.numel():
            ptr = x.untyped_storage().data_ptr()
            if ptr in seen:
                x = x.clone()
                ptr = x.untyped_storage().data_ptr()
            seen.add(ptr)
        out[name] = x
    return out


def write_rank_file(out: Path, index: int, tensors: dict[str, torch.Tensor]) -> Path:
    """Write one dst rank's shards to out/rank-NNNNN.safetensors (temp file + rename). Returns the path."""
    from safetensors.torch import save_file
    final = Path(out) / rank_file_name(index)
    data = _unshared(tensors)
    atomic_write(final, lambda tmp: save_file(data, tmp, metadata={"format": FORMAT, "index": str(index)}))
    return final


def _layout_doc(layout: Layout) -> dict[str, Any]:
    try:
        text = Path(layout.file).read_text()
    except (OSError, UnicodeDecodeError):
        text = None
    return {"name": layout.name, "file": str(layout.file), "ranks": list(layout.ranks), "yaml": text}


def build_manifest(src: Layout, dst: Layout, ranks: list[dict]) -> dict:
    """The output manifest from what each dst rank reports ({"index", "rank", "tensors"}), ordered by index."""
    out_ranks = []
    for r in sorted(ranks, key=lambda r: r["index"]):
        out_ranks.append({"index": int(r["index"]), "rank": int(r["rank"]), "file": rank_file_name(int(r["index"])),
                          "tensors": r.get("tensors", {})})
    return {"format": FORMAT, "model": src.manifest.name, "src": _layout_doc(src), "dst": _layout_doc(dst),
            "ranks": out_ranks}


def write_manifest(out: Path, manifest: dict) -> None:
    """Write out/manifest.json atomically. Call it last, once every rank file is written and verified."""
    final = Path(out) / MANIFEST_NAME
    atomic_write_text(final, json.dumps(manifest, indent=1) + "\n", fsync=True)


def read_manifest(out: Path) -> dict:
    """The manifest of an output directory; ConfigError naming the file if missing, unparseable or foreign."""
    path = Path(out) / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("manifest is missing (not a reshard output directory, or the run did not finish)",
                          file=str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read manifest: {e}", file=str(path)) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"corrupt manifest: {e}", file=str(path)) from None
    if not isinstance(doc, dict):
        raise ConfigError("corrupt manifest: not a JSON object", file=str(path))
    if doc.get("format") != FORMAT:
        raise ConfigError(f"unknown format {doc.get('format')!r} (expected {FORMAT!r})", file=str(path),
                          key="format")
    if not isinstance(doc.get("ranks"), list):
        raise ConfigError("expected a list", file=str(path), key="ranks")
    return doc


__all__ = ["FORMAT", "MANIFEST_NAME", "rank_file_name", "prepare_out_dir", "write_rank_file", "build_manifest",
           "write_manifest", "read_manifest"]
