"""The one interface every storage format implements, and the checks formats share.

A format is how a framework keeps a checkpoint's tensors. Plans stay in checkpoint space (the HF names and
shapes); a format maps that space to the framework's own storage:

- `expand(doc, manifest, file)`: the layout document with what the format derives (meshes, pipeline split,
  expert owners, placement rules) filled in from the framework's own parallel arguments;
- `engine(doc, file)`: what the layout says about the engine it runs in (`engine: {url: ..., stage_mb: ...}`):
  `url`, a running engine to push into, and `stage_mb`, what each of its workers stages at once (each None
  when not given);
- `storage(layout, rank)`: the framework's tensors on one rank, each with the views of checkpoint boxes it is
  made of (`formats.storage.EngineTensor`);
- `bind(params, layout, rank, casts)`: a live model's parameters as views of this rank's checkpoint tensors,
  keyed by checkpoint name, checked against the layout (what `Refit` reads from or writes into);
- `summary(layout, rank)`: what one rank's storage holds, for `reshard plan`;
- `live_layout_doc(model, checkpoint, rank=, file=)`: the layout document of a running model, where the
  framework can say it (Megatron's parallel_state).

A format that has no such notion leaves the field None. `keys` are the top-level layout keys the format owns
(`engine:`, `megatron:`), each with what it holds: another format's layout may not use them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from reshard_cli.errors import ConfigError
from reshard_cli.layouts.models import ARCHITECTURES


@dataclass(frozen=True)
class Format:
    name: str
    description: str
    keys: dict = field(default_factory=dict)  # top-level layout key -> what it holds (for errors)
    expand: Callable | None = None
    engine: Callable | None = None
    storage: Callable | None = None
    bind: Callable | None = None
    summary: Callable | None = None
    live_layout_doc: Callable | None = None


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


def known_family(config: dict, fmt: str, framework: str, file: str) -> None:
    """A ConfigError unless this format's storage rules know the model's family. A model without a hand table
    (`layouts.models.ARCHITECTURES`) is listed from transformers' own classes and plans in checkpoint format
    (`format: hf`, an FSDP2/DTensor trainer), but where `framework` keeps its tensors is not restated for it:
    default rules would place a Mamba `in_proj` or a fused linear-attention projection wrongly, and silently."""
    family = config.get("model_type")
    if family not in ARCHITECTURES:
        raise ConfigError(f"`format: {fmt}` knows {framework}'s storage of {', '.join(ARCHITECTURES)}, not of "
                          f"{family!r} (its checkpoint plans and refits as `format: hf`)", file=file, key="format")


def checked_stage_mb(value, key: str = "stage_mb", file: str | None = None, line: int | None = None) -> float | None:
    """What each engine worker stages at once, in MiB (0: the whole model in one group), as a float; None
    stays None. The one check of every place a user gives it (a layout's `engine: {stage_mb}`, `--stage-mb`,
    `Refit(stage_mb=)`, the engine's init info): anything but a number >= 0 is refused in one line naming
    `key`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"must be >= 0 MiB (0: the whole model at once), not {value!r}", file=file, key=key,
                          line=line)
    return float(value)


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
    def item(et, v) -> int:  # what a checkpoint element takes in the framework's tensor (FP8: one byte)
        return 1 if et.dtype.startswith("float8") else layout.manifest.tensors[v.tensor].itemsize

    filled = sum(v.box.numel * item(et, v) for et in tensors for v in et.views) + \
        sum(et.nbytes for et in tensors if et.scales)  # an FP8 engine's scales are written whole
    total = sum(et.nbytes for et in tensors)
    return {"format": layout.format, "rank": rank, "direct_bytes": filled, "padding_bytes": total - filled,
            "total_bytes": total}
