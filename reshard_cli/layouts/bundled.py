"""What reshard ships: model configs, layout pairs, topologies, benchmark suites and the CPU demo.

They live in the repository's top-level `layouts/` folder:

    layouts/models/<model>.json          HF config.json files           (a layout's `model:` by name)
    layouts/<model>/<layout>.yaml        trainer / inference layouts    (`--src deepseek-v3/megatron-pp16-ep16`)
    layouts/demo/{train,infer}.yaml      the CPU demo pair              (`--src demo/train`)
    layouts/topologies/<name>.yaml       topologies                     (`--topology dgx-h100`)
    layouts/suites/<name>.yaml           benchmark suites               (`reshard bench --suite cpu`)

A built wheel carries the same folder as package data (`reshard_cli/_data`, mapped in pyproject.toml), so an
installed reshard finds its bundled files from any directory; a source checkout or an editable install reads
the repository's folder. A path that exists always wins over a bundled name; `layouts/...` paths written from
the repository root (as the README does) also resolve to the bundled file when run from elsewhere.
"""
from __future__ import annotations

import difflib
from functools import lru_cache
from pathlib import Path

from reshard_cli.errors import ConfigError

_PACKAGE = Path(__file__).resolve().parent.parent
KINDS = {"layout": "", "topology": "topologies", "suite": "suites", "model": "models"}
_SUFFIX = {"layout": ".yaml", "topology": ".yaml", "suite": ".yaml", "model": ".json"}
_NOT_LAYOUTS = ("models", "topologies", "suites")


@lru_cache(maxsize=1)
def data_dir() -> Path:
    """The bundled data folder: inside the installed package (a wheel), else the repository's `layouts/`."""
    for candidate in (_PACKAGE / "_data", _PACKAGE.parent / "layouts"):
        if (candidate / "models").is_dir():
            return candidate
    raise ConfigError(f"bundled data is missing from this installation (looked in {_PACKAGE / '_data'} and "
                      f"{_PACKAGE.parent / 'layouts'}); reinstall reshard")


def names(kind: str) -> list[str]:
    """Bundled names of one kind: layouts as 'model/layout', the others by file stem."""
    root = data_dir()
    if kind == "layout":
        return sorted(f"{p.parent.name}/{p.stem}" for p in root.glob("*/*.yaml") if p.parent.name not in _NOT_LAYOUTS)
    return sorted(p.stem for p in (root / KINDS[kind]).glob(f"*{_SUFFIX[kind]}"))


def bundled_path(kind: str, spec: str | Path) -> Path | None:
    """The bundled file `spec` names (`dgx-h100`, `topologies/dgx-h100.yaml`, `layouts/demo/train.yaml`,
    `deepseek-v3/vllm-tp32-dp8`), or None."""
    text = str(spec).strip().replace("\\", "/")
    text = text.removeprefix("./").removeprefix("layouts/")
    for suffix in (".yaml", ".yml", ".json"):
        text = text.removesuffix(suffix)
    if kind != "layout":
        text = text.removeprefix(KINDS[kind] + "/")
    if not text or ".." in text.split("/"):
        return None
    path = data_dir() / KINDS[kind] / f"{text}{_SUFFIX[kind]}"
    return path if path.is_file() else None


def resolve(kind: str, spec: str | Path) -> Path:
    """A file given as a path (it exists) or as a bundled name; else a one-line error naming it and the
    closest bundled names."""
    path = Path(spec).expanduser()
    if path.exists():  # a path the user gave (the loader says what is wrong with it, if anything)
        return path
    found = bundled_path(kind, spec)
    if found is not None:
        return found
    if path.is_absolute():
        raise ConfigError("file not found", file=str(path))
    known = names(kind)
    close = difflib.get_close_matches(str(spec).removeprefix("layouts/").removesuffix(".yaml"), known, n=3)
    hint = f"did you mean {', '.join(close)}?" if close else f"bundled: {', '.join(known)}"
    raise ConfigError(f"file not found, and no bundled {kind} of that name ({hint})", file=str(spec))
