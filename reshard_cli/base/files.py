"""Atomic file writes (a final name never holds a half-written file) and reshard's cache of what it learnt once
(storage maps, tensor lists): one JSON file per key, per version of the tool that computed it."""
from __future__ import annotations

import json
import os
import secrets
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from reshard_cli.errors import ConfigError


def atomic_write(final: str | Path, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` for a temporary file beside `final`, then rename it to `final`; the temporary
    file is removed if anything fails. A `final` that exists and is not a regular file (/dev/null, /dev/stdout,
    a pipe) is written in place: renaming over it would replace it."""
    final = Path(final)
    if final.exists() and not final.is_file():
        write(str(final))
        return
    tmp = final.parent / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        write(str(tmp))
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_text(final: str | Path, text: str, *, fsync: bool = False) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write(text)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())

    atomic_write(final, write)


def cache_root() -> Path:
    """Where reshard keeps what it learnt once (storage maps, tensor lists): `$RESHARD_CACHE`, else
    `~/.cache/reshard`."""
    return Path(os.environ.get("RESHARD_CACHE") or Path.home() / ".cache" / "reshard")


def installed_version(*dists: str) -> str | None:
    """The version of the first of `dists` that is installed, read without importing it; None if none is."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def cache_path(kind: str, key: str, tool: str, version: str) -> Path:
    """Where the cache keeps `key` of `kind` as computed by `tool` `version`."""
    return cache_root() / kind / f"{key}-{tool}{version}.json"


def cache_read(kind: str, key: str, tool: str, version: str | None, what: str,
               parse: Callable[[Any], Any] = lambda obj: obj) -> Any:
    """`parse` of the cached JSON of `key` (`cache_path`) from that `version` of `tool`; with `version` None
    (the tool not installed here), the newest from any version; None when there is none. A file that cannot
    be read or parsed is a ConfigError naming it (`what`: what it holds)."""
    if version is not None:
        found = [cache_path(kind, key, tool, version)]
    else:
        found = sorted((cache_root() / kind).glob(f"{key}-{tool}*.json"), key=lambda p: p.stat().st_mtime)[-1:]
    for path in (p for p in found if p.exists()):
        try:
            return parse(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"unreadable {what} ({type(e).__name__}: {e}); delete it to compute it again",
                              file=str(path)) from None
    return None


def cache_write(kind: str, key: str, tool: str, version: str | None, obj: Any) -> Path:
    """Write `obj` as JSON to `cache_path`, atomically (OSError where the cache cannot be written)."""
    path = cache_path(kind, key, tool, version or "")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj))
    return path
