"""Topology: which global ranks share a fast (NVLink) domain, plus optional link figures.

YAML (`reshard plan --topology FILE`):

    name: dgx-h100
    ranks_per_domain: 8          # consecutive global ranks form a domain: 0-7, 8-15, ...
    # or: domains: ['0-7', '8-15', [16, 17, 18, 19]]   (ranks not listed are each their own domain)
    links:                       # optional; used by the cost model
      network_gbps: 50           # per rank, per direction, GB/s (a 400 Gb/s NIC = 50 GB/s)
      nvlink_gbps: 450           # per rank, per direction, inside a domain, GB/s
      latency_us: 10             # per message

Discovery through NVML lives in `reshard_cli/hw/nvml.py`; it produces the same `Topology`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard_cli.errors import ConfigError
from reshard_cli.layouts import bundled
from reshard_cli.layouts.yamlio import check_keys, format_ranks, line_of, load_yaml, parse_ranks

LINK_KEYS = ("network_gbps", "nvlink_gbps", "latency_us")


@dataclass(frozen=True)
class Topology:
    name: str = "none"
    ranks_per_domain: int | None = None
    domains: tuple[tuple[int, ...], ...] = ()
    links: dict = field(default_factory=dict)

    def __post_init__(self):
        lookup: dict[int, int] = {}
        for i, dom in enumerate(self.domains):
            for r in dom:
                if r in lookup:
                    raise ConfigError(f"rank {r} is in two domains", key="domains")
                lookup[r] = i
        object.__setattr__(self, "_lookup", lookup)

    @property
    def grouped(self) -> bool:
        """False when every rank is its own domain (no topology given)."""
        return bool(self.domains) or (self.ranks_per_domain or 1) > 1

    def domain_of(self, rank: int) -> int:
        """A domain id; equal ids mean the ranks share NVLink. Ungrouped ranks get unique negative ids."""
        if self.domains:
            d = self._lookup.get(rank)  # type: ignore[attr-defined]
            return d if d is not None else -1 - rank
        if self.ranks_per_domain:
            return rank // self.ranks_per_domain
        return -1 - rank

    def describe(self) -> str:
        if self.domains:
            return f"{self.name}: {len(self.domains)} domains"
        if self.ranks_per_domain:
            return f"{self.name}: {self.ranks_per_domain} ranks per domain"
        return "none (every rank is its own domain)"

    def to_yaml_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.domains:
            out["domains"] = [format_ranks(d) for d in self.domains]
        elif self.ranks_per_domain:
            out["ranks_per_domain"] = self.ranks_per_domain
        if self.links:
            out["links"] = dict(self.links)
        return out


NO_TOPOLOGY = Topology()


def load_topology(path: str | Path) -> Topology:
    """A topology YAML, by path or bundled name (`dgx-h100`)."""
    path = bundled.resolve("topology", path)
    file = str(path)
    doc = load_yaml(path)
    check_keys(doc, ("name", "ranks_per_domain", "domains", "links", "description", "gpus"), file=file, where="")
    if ("ranks_per_domain" in doc) == ("domains" in doc):
        raise ConfigError("give exactly one of ranks_per_domain or domains", file=file, line=getattr(doc, "line", None))
    name = str(doc.get("name", Path(file).stem))
    rpd = None
    domains: tuple[tuple[int, ...], ...] = ()
    if "ranks_per_domain" in doc:
        rpd = doc["ranks_per_domain"]
        if not isinstance(rpd, int) or isinstance(rpd, bool) or rpd < 1:
            raise ConfigError("must be a positive integer", file=file, key="ranks_per_domain",
                              line=line_of(doc, "ranks_per_domain"))
    else:
        raw = doc["domains"]
        if not isinstance(raw, list) or not raw:
            raise ConfigError("must be a non-empty list of rank ranges", file=file, key="domains",
                              line=line_of(doc, "domains"))
        domains = tuple(parse_ranks(d, file=file, key=f"domains[{i}]", line=line_of(doc, "domains"))
                        for i, d in enumerate(raw))
    links: dict[str, float] = {}
    if "links" in doc:
        check_keys(doc["links"], LINK_KEYS, file=file, where="links")
        for k, v in doc["links"].items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ConfigError("must be a non-negative number", file=file, key=f"links.{k}",
                                  line=line_of(doc["links"], k))
            links[k] = float(v)
    try:
        return Topology(name=name, ranks_per_domain=rpd, domains=domains, links=links)
    except ConfigError as e:
        raise ConfigError(str(e), file=file, line=line_of(doc, "domains")) from None
