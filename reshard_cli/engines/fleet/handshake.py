"""What both sides of a refit group share before a byte moves, whatever the engine: the two layouts from the
YAML text the init info carries, and the handshake in which every trainer rank and every engine worker agree
on the model (or on one rank's error). Imports no engine."""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import Mapping

from reshard_cli.errors import ConfigError
from reshard_cli.hw import nvml
from reshard_cli.layouts.topology import NO_TOPOLOGY, Topology, load_topology
from reshard_cli.plan.fleet import fleet_of
from reshard_cli.formats import load_layout, load_pair
from reshard_cli.transfer.agree import Failure, one_line

NUMBERS = "update numbers"  # the collective after an update where the trainer collects every worker's numbers


def digest(layout=None, tensors: Mapping | None = None) -> list | None:
    """A model as sorted (name, global shape, dtype) triples: from a layout, or from DTensors' global shapes."""
    if layout is not None:
        return sorted((t.name, tuple(t.shape), t.dtype) for t in layout.manifest.tensors)
    if tensors is not None:
        return sorted((n, tuple(x.shape), str(x.dtype).removeprefix("torch.")) for n, x in tensors.items())
    return None


@dataclass(frozen=True)
class Agreed:
    """What every rank of a refit group said in the handshake, in refit-rank order: its NVLink domain key
    (`topology: auto`), and whether the engine's update session is open on it (a worker whose previous trainer
    started an update and never finished it: the next trainer finishes it before starting its own)."""

    domains: list
    open_updates: list


def handshake(comm, role: str, model, error: str | None, domain: str | None = None, *,
              open_update: bool = False, settings: dict | None = None) -> Agreed:
    """Collective over the refit group: every rank says its role, a hash of its model (None: derived from
    DTensors later), whether its own checks passed, its NVLink domain key and (a worker) whether an update
    session is open on it, and the `settings` every rank must share (its transport). Every rank raises the same
    one-line ConfigError if any failed, two models differ or two ranks' settings do, so no side waits for a
    transfer that will not come. Only when the hashes differ do the ranks exchange the
    models themselves, to name the first difference."""
    mine = hashlib.sha256(repr(model).encode()).hexdigest() if model is not None else None
    everyone = comm.all_gather_object({"role": role, "model": mine, "error": error, "domain": domain,
                                       "open": open_update, "settings": settings or {}})
    if hasattr(comm, "name_ranks"):
        comm.name_ranks([x["role"] for x in everyone])
    failures = [Failure(r, x["error"], 2, x["role"]) for r, x in enumerate(everyone) if x["error"]]
    if failures:
        raise ConfigError(one_line(failures, label="refit rank"))
    for r, x in enumerate(everyone):
        for key, value in x["settings"].items():
            if value != everyone[0]["settings"].get(key):
                raise ConfigError(f"refit ranks 0 ({everyone[0]['role']}) and {r} ({x['role']}) were given "
                                  f"different {key}s: {everyone[0]['settings'].get(key)!r} and {value!r}", key=key)
    agreed = Agreed([x["domain"] for x in everyone], [bool(x.get("open")) for x in everyone])
    if len({x["model"] for x in everyone if x["model"] is not None}) < 2:
        return agreed
    models = [(r, m) for r, m in enumerate(comm.all_gather_object(model)) if m is not None]
    r0, m0 = models[0]
    for r, m in models[1:]:
        if m != m0:
            raise ConfigError(f"refit ranks {r0} ({everyone[r0]['role']}) and {r} ({everyone[r]['role']}) have "
                              f"different models: {_first_difference(m0, m)}", key="model")
    return agreed


def rank_names(dst, engine: str):
    """What each refit rank is, from the engine's layout alone: its workers ("vLLM worker i", or "vLLM replica r
    worker w" in a fleet, for `engine` "vLLM"), and the trainer's ranks ("trainer r") around them."""
    fleet = fleet_of(dst)

    def name(rank: int) -> str:
        if rank not in dst.ranks:
            return f"trainer {rank}"
        i = dst.ranks.index(rank)
        if fleet.replicas == 1:
            return f"{engine} worker {i}"
        return f"{engine} replica {fleet.replica_of(i)} worker {i % fleet.per_replica}"
    return name


def domain_key(topology: str, device) -> str | None:
    """This rank's NVLink domain key when the refit's topology is discovered (`auto`): its GPU's, through NVML,
    or its host's on a CPU."""
    if topology.strip() != "auto":
        return None
    index = device.index if device.type == "cuda" and device.index is not None else 0
    try:
        return nvml.rank_domain_key(nvml.discover(), index)
    except ConfigError:  # a GPU NVML cannot place: a domain of its own (the plan stays right, only slower)
        return f"unplaced-{os.getpid()}"


def refit_topology(topology: str, domains: list) -> Topology:
    """The refit group's topology, the same on every rank: none (""), discovered (`auto`: ranks whose domain
    keys, exchanged in the handshake, are equal share a domain), a bundled name (`gb200-nvl72`), or a topology
    file's YAML text. Its ranks are refit ranks: the trainer's first, then the engine's workers."""
    text = topology.strip()
    if not text:
        return NO_TOPOLOGY
    if text == "auto":
        return nvml.domains_from_keys(domains)
    if "\n" not in text and ":" not in text:
        return load_topology(text)
    with tempfile.TemporaryDirectory(prefix="reshard-refit-") as tmp:
        path = os.path.join(tmp, "topology.yaml")
        with open(path, "w") as f:
            f.write(text)
        try:
            return load_topology(path)
        except ConfigError as e:  # named for what the user gave, not the temporary file
            raise ConfigError(str(e).replace(path, "topology")) from None


def _first_difference(m0: list, m: list) -> str:
    a, b = {n: (s, d) for n, s, d in m0}, {n: (s, d) for n, s, d in m}
    missing = sorted(set(a) ^ set(b))
    if missing:
        return f"{missing[0]!r} is in one model only"
    return next(f"{n}: {list(a[n][0])} {a[n][1]} vs {list(b[n][0])} {b[n][1]}" for n in a if a[n] != b[n])


def layouts(src_text: str, dst_text: str, trainer_size: int = 0):
    """The two layouts from YAML text (src may be empty: read from DTensors at the first refit; the engine's
    ranks then start after the trainer's `trainer_size` unless its layout says otherwise)."""
    with tempfile.TemporaryDirectory(prefix="reshard-refit-") as tmp:
        paths = {}
        for name, text in (("src.yaml", src_text), ("dst.yaml", dst_text)):
            if text:
                paths[name] = os.path.join(tmp, name)
                with open(paths[name], "w") as f:
                    f.write(text)
        if "dst.yaml" not in paths:
            raise ConfigError("the engine's layout (dst) is empty", key="dst")
        if "src.yaml" in paths:
            return load_pair(paths["src.yaml"], paths["dst.yaml"])
        return None, load_layout(paths["dst.yaml"], first_rank=trainer_size)
