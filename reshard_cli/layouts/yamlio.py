"""Safe YAML loading that remembers line numbers, and small parsers shared by every YAML file.

Every mapping loads as a `Mapping` (a dict) whose `.lines` gives the 1-based line of each key, so an error
can say `train.yaml:12: placements[2].shard: ...`. Unknown keys are errors: a typo must not be ignored.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml

from reshard_cli.errors import ConfigError


class Mapping(dict):
    """A dict that knows the line of each key (and of itself)."""

    lines: dict
    line: int | None = None


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> Mapping:
    loader.flatten_mapping(node)
    out = Mapping()
    out.lines = {}
    out.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise ConfigError(f"a key must be a plain value, not a {type(key).__name__}",
                              line=key_node.start_mark.line + 1) from None
        if key in out:
            raise ConfigError(f"duplicate key {key!r}", line=key_node.start_mark.line + 1)
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = key_node.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str | Path) -> Any:
    """Load one YAML document safely; errors name the file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read: {e.__class__.__name__}: {e}", file=str(path)) from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
    except ConfigError as e:
        raise ConfigError(str(e).split(": ", 1)[-1], file=str(path), line=e.line) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"YAML syntax error: {problem}", file=str(path), line=line) from None


def line_of(mapping: Any, key: str) -> int | None:
    if isinstance(mapping, Mapping):
        return mapping.lines.get(key, mapping.line)
    return None  # a plain dict (a document built in code) has no lines


def check_keys(mapping: Any, allowed: Iterable[str], *, file: str, where: str, required: Iterable[str] = ()) -> None:
    """Reject keys not in `allowed` (suggesting the closest one) and missing `required` keys."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"expected a mapping, got {type(mapping).__name__}", file=file, key=where or None,
                          line=getattr(mapping, "line", None))
    allowed = list(allowed)
    for key in mapping:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (allowed: {', '.join(allowed)})"
            raise ConfigError(f"unknown key{hint}", file=file, key=_join(where, str(key)),
                              line=line_of(mapping, key))
    for key in required:
        if key not in mapping:
            raise ConfigError("missing required key", file=file, key=_join(where, key), line=getattr(mapping, "line", None))


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def parse_ranks(value: Any, *, file: str, key: str, line: int | None = None) -> tuple[int, ...]:
    """'0-15', '0-7,16-23', 8 (meaning 0..7 is NOT implied: an int is one rank), or a list of ints/ranges."""
    items: list[Any]
    if isinstance(value, bool):
        raise ConfigError("expected ranks like '0-15' or a list", file=file, key=key, line=line)
    if isinstance(value, int):
        items = [value]
    elif isinstance(value, str):
        items = [s.strip() for s in value.split(",") if s.strip()]
    elif isinstance(value, list):
        items = value
    else:
        raise ConfigError("expected ranks like '0-15' or a list", file=file, key=key, line=line)
    out: list[int] = []
    for item in items:
        if isinstance(item, bool):
            raise ConfigError(f"bad rank {item!r}", file=file, key=key, line=line)
        if isinstance(item, int):
            out.append(item)
            continue
        text = str(item).strip()
        try:
            if "-" in text:
                lo, hi = (int(x) for x in text.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(text))
        except ValueError:
            raise ConfigError(f"bad rank range {text!r} (write '0-15')", file=file, key=key, line=line) from None
    if any(r < 0 for r in out):
        raise ConfigError("ranks must be >= 0", file=file, key=key, line=line)
    if len(set(out)) != len(out):
        raise ConfigError("a rank is listed twice", file=file, key=key, line=line)
    return tuple(out)


def format_ranks(ranks: Iterable[int]) -> str:
    """Inverse of parse_ranks for display: (0,1,2,5) -> '0-2,5'."""
    ranks = list(ranks)
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)
