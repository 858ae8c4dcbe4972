"""Human tables (nccl-tests style), byte and count figures, and the JSON twin written atomically."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from reshard_cli.base.files import atomic_write_text
from reshard_cli.errors import ConfigError


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, indent: str = "  ") -> str:
    """Right-aligned columns (first column left-aligned), nccl-tests style."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        parts = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append(indent + ("# " if j == 0 else "  ") + "  ".join(parts).rstrip())
    return "\n".join(lines)


def pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f} %" if whole else "-"


def write_json(path: str | Path, doc: dict) -> None:
    """Write atomically (temp file + rename) so a reader never sees half a file (`atomic_write`: /dev/null or a
    pipe is written in place)."""
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")


def write_json_option(option: str, path: str | Path, doc: dict) -> None:
    """`write_json` for a command-line option: an unwritable path is bad input (exit 2) naming the option."""
    try:
        write_json(path, doc)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}", key=option) from None
