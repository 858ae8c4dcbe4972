"""Engine and trainer storage formats, behind one interface (`base.Format`), and layouts loaded through them.

A layout's `format:` (default `hf`: the checkpoint's own names and shapes) names one format of `FORMATS`. A
format maps the framework's real storage to views of checkpoint tensors, so plans stay in checkpoint space
while the bytes land straight in the framework's own tensors. Adding a format is its own module and one line
in `FORMATS`; every other package asks `get(layout.format)`.

`load_layout`, `load_pair` and `layout_from_doc` are how every command and API reads a layout: the format
expands its document, then `layouts.layout` builds the placements.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from reshard_cli.errors import ConfigError
from reshard_cli.formats import hf, megatron, vllm
from reshard_cli.formats.base import Format
from reshard_cli.layouts import bundled
from reshard_cli.layouts import layout as _layout
from reshard_cli.layouts.yamlio import line_of, load_yaml

FORMATS: dict[str, Format] = {f.name: f for f in (hf.FORMAT, vllm.FORMAT, megatron.FORMAT)}
_OWNED = {key: f for f in FORMATS.values() for key in f.keys}  # top-level layout keys a format owns


def get(name: str, *, file: str | None = None, line: int | None = None) -> Format:
    """The format called `name`; an unknown one is a ConfigError naming the layout's `format:` key."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ConfigError(f"unknown format {name!r} (formats: {', '.join(FORMATS)})", file=file, key="format",
                          line=line)
    return fmt


def layout_from_doc(doc: dict, *, file: str, first_rank: int = 0, scale: int = 1) -> _layout.Layout:
    """A layout from its document (a loaded YAML file, or one a helper wrote, e.g. from a live Megatron model),
    expanded by its format; `file` names it in errors and relative paths resolve against its directory."""
    name = doc.get("format", "hf") if isinstance(doc, dict) else "hf"
    fmt = get(name, file=file, line=line_of(doc, "format") if isinstance(doc, dict) else None)
    if isinstance(doc, dict):
        for key, owner in _OWNED.items():
            if key in doc and owner is not fmt:
                raise ConfigError(f"`{key}:` {owner.keys[key]}; it needs `format: {owner.name}` (this layout has "
                                  f"format: {fmt.name})", file=file, key=key, line=line_of(doc, key))
    engine = fmt.engine(doc, file) if fmt.engine else None
    return _layout.layout_from_doc(doc, file=file, first_rank=first_rank, scale=scale, format=fmt.name,
                                   expand=fmt.expand, engine=engine, format_keys=tuple(_OWNED))


def load_layout(path: str | Path, *, first_rank: int = 0, scale: int = 1) -> _layout.Layout:
    """Load and validate a layout YAML (a path, or a bundled name). `first_rank` is where `ranks` starts when
    the file omits it."""
    path = bundled.resolve("layout", path)
    return layout_from_doc(load_yaml(path), file=str(path), first_rank=first_rank, scale=scale)


def load_pair(src_path: str | Path, dst_path: str | Path, *, scale: int = 1) -> tuple[_layout.Layout, _layout.Layout]:
    """Source and destination layouts: the destination's ranks follow the source's unless given; both must
    describe the same model."""
    src = load_layout(src_path, scale=scale)
    dst = load_layout(dst_path, first_rank=max(src.ranks) + 1, scale=scale)
    return _layout.check_pair(src, dst)


def with_replicas(layout: _layout.Layout, replicas: int, *, after: _layout.Layout | None = None,
                  scale: int = 1) -> _layout.Layout:
    """`layout`'s replica `replicas` times (`layouts.layout.replicated_doc`: the `dp` of its mesh set to
    `replicas`, the replica's own parallelism unchanged), read again from its file through its format (an
    engine's expert parallelism spreads the experts over the new dp × tp ranks, as the engine would). Its ranks
    follow `after`'s, as `load_pair` numbers a pair's destination, with its tensors in `after`'s order; without
    `after` they start where `layout`'s do. `scale`: as the layout was loaded with. The name says the replicas
    when their number changes."""
    file = layout.file
    if not Path(file).is_file():
        raise ConfigError("a layout not read from a file cannot be replicated: write it as YAML", file=file,
                          key="mesh")
    doc = load_yaml(file)
    if not isinstance(doc, dict):
        raise ConfigError(f"expected a mapping, got {type(doc).__name__}", file=file)
    grown = _layout.replicated_doc(doc, replicas, file=file)
    first = max(after.ranks) + 1 if after is not None else layout.ranks[0]
    out = layout_from_doc(grown, file=file, first_rank=first, scale=scale)
    if out.size != layout.size:  # the replica's size is unchanged: their number changed
        out = replace(out, name=f"{layout.name} as {replicas} replica{'s' if replicas != 1 else ''}")
    return _layout.check_pair(after, out)[1] if after is not None else out


def live_layout(fmt: str, model, checkpoint, *, rank: int | None = None, file: str | None = None) -> _layout.Layout:
    """The layout of a running model of framework `fmt` (what `Refit(src=...)` takes), derived from the
    framework itself where the format can (`megatron`: parallel_state)."""
    f = get(fmt)
    if f.live_layout_doc is None:
        raise ConfigError(f"`format: {f.name}` cannot derive a layout from a running model; write the layout",
                          key="format")
    file = file or f"<{f.name} model>"
    return layout_from_doc(f.live_layout_doc(model, checkpoint, rank=rank, file=file), file=file)


def summary(layout) -> dict | None:
    """A framework's storage on the first rank of `layout` (the format's `summary`), None for `hf`."""
    fmt = get(layout.format)
    return fmt.summary(layout) if fmt.summary else None


__all__ = ["FORMATS", "Format", "get", "layout_from_doc", "load_layout", "load_pair", "live_layout", "with_replicas",
           "summary"]
