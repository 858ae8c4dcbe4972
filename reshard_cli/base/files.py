"""Atomic file writes (a final name never holds a half-written file) and reshard's cache folder."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable


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
