"""Engine and trainer storage formats: how a framework keeps a checkpoint's tensors.

A layout's `format:` (default `hf`: the checkpoint's own names and shapes) names one of these. A format maps
the framework's real storage to views of checkpoint tensors, so plans stay in checkpoint space while the
bytes land straight in the framework's own tensors.
"""
from __future__ import annotations

from reshard_cli.errors import ConfigError

FORMATS = ("hf", "vllm", "megatron")


def doc_line(mapping, key):
    """The line of `key` in a loaded YAML mapping (None for a document built in code)."""
    lines = getattr(mapping, "lines", None)
    return lines.get(key) if lines else getattr(mapping, "line", None)


def format_mesh(doc: dict, fmt: str, dims: tuple, derived: tuple, options: str, file: str) -> list[str]:
    """A format layout's common checks: no key the format derives, and `mesh:` with dims among `dims` in
    that order (slowest first). Returns the mesh's dims."""
    for key in derived:
        if key in doc:
            raise ConfigError(f"`{key}:` is derived by `format: {fmt}` from the mesh and `{options}:`; remove it",
                              file=file, key=key, line=doc_line(doc, key))
    mesh = doc.get("mesh")
    order = ", ".join(dims)
    if not isinstance(mesh, dict) or not mesh:
        raise ConfigError(f"`format: {fmt}` needs `mesh:` with dims among {order} (tp fastest)", file=file,
                          key="mesh", line=doc_line(doc, "mesh"))
    got = [str(d) for d in mesh]
    if any(d not in dims for d in got) or got != sorted(got, key=dims.index):
        raise ConfigError(f"the {fmt} mesh dims are {order} in that order (tp fastest), got {got}", file=file,
                          key="mesh", line=doc_line(doc, "mesh"))
    return got


def format_options(doc: dict, key: str, allowed: tuple, file: str) -> dict:
    """A format's own mapping (`engine:`, `megatron:`), its keys checked."""
    opts = doc.get(key) or {}
    if not isinstance(opts, dict):
        raise ConfigError("expected a mapping", file=file, key=key, line=doc_line(doc, key))
    for k in opts:
        if k not in allowed:
            raise ConfigError(f"unknown key (allowed: {', '.join(allowed)})", file=file, key=f"{key}.{k}",
                              line=doc_line(opts, k))
    return opts


def storage_summary(layout, tensors: list, rank: int) -> dict:
    """Bytes of a rank's framework tensors (`formats.storage.EngineTensor`s) and of the checkpoint boxes their
    views cover."""
    filled = sum(v.box.numel * layout.manifest.tensors[v.tensor].itemsize for et in tensors for v in et.views)
    total = sum(et.nbytes for et in tensors)
    return {"format": layout.format, "rank": rank, "direct_bytes": filled, "padding_bytes": total - filled,
            "total_bytes": total}


def engine_summary(layout) -> dict:
    """A framework's storage on one rank of `layout` (see the format's `summary`)."""
    from reshard_cli.formats import megatron, vllm

    return {"vllm": vllm.summary, "megatron": megatron.summary}[layout.format](layout)
