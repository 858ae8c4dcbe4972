"""A fleet's members as the refit counts them: each member (one engine's client) drives some of the layout's
replicas, in the order the layout's `dp` lists them, and each replica's workers are refit ranks after the
trainer's. `Replicas` is that arithmetic, in one place; `fleet_layout` is the layout for a set of members."""
from __future__ import annotations

from dataclasses import dataclass

import yaml

from reshard_cli.errors import ConfigError
from reshard_cli.layouts.layout import replicated_doc
from reshard_cli.plan.fleet import fleet_of


def replicas_of(client) -> int:
    """The layout replicas one client's engine drives: its `replicas` (an engine's data parallelism), one
    without."""
    return int(getattr(client, "replicas", None) or 1)


@dataclass(frozen=True)
class Replicas:
    """Which layout replicas and refit ranks each member drives: member i drives `counts[i]` replicas, from
    replica `bases[i]` on, each of `per_replica` workers, the first member's first worker being refit rank
    `first_rank` (the trainer's ranks come first)."""

    counts: tuple[int, ...]
    per_replica: int = 1
    first_rank: int = 0

    @classmethod
    def of(cls, clients: list, dst, first_rank: int = 0) -> Replicas:
        """The members `clients` of a fleet whose layout is `dst`. A client says how many replicas it drives
        with `replicas` (one without; a single client without it drives the whole layout). More or fewer than
        the layout's `dp` is one ConfigError, before any engine is called."""
        fleet = fleet_of(dst)
        if len(clients) == 1 and getattr(clients[0], "replicas", None) is None:
            return cls((fleet.replicas,), fleet.per_replica, first_rank)
        counts = tuple(replicas_of(c) for c in clients)
        if sum(counts) != fleet.replicas:
            raise ConfigError(f"the layout has {fleet.replicas} replica(s) (dp {fleet.replicas}), the {len(clients)} "
                              f"engine client(s) drive {sum(counts)} ({' + '.join(map(str, counts))})", key="dst")
        return cls(counts, fleet.per_replica, first_rank)

    @classmethod
    def none(cls, dst, first_rank: int = 0) -> Replicas:
        """No members: what a trainer rank that drives no engine (every rank but 0) knows of the fleet."""
        return cls((), fleet_of(dst).per_replica, first_rank)

    @property
    def total(self) -> int:
        """The replicas the members drive together: the `dp` of their fleet's layout."""
        return sum(self.counts)

    @property
    def bases(self) -> list[int]:
        """The layout replica each member's engine starts at: the replicas of the members before it."""
        return [sum(self.counts[:i]) for i in range(len(self.counts))]

    def ranks(self) -> list[range]:
        """Each member's workers, as refit ranks (its replicas' ranks, after the trainer's)."""
        return [range(self.first_rank + base * self.per_replica, self.first_rank + (base + n) * self.per_replica)
                for base, n in zip(self.bases, self.counts)]

    def members_of(self, ranks) -> set[int]:
        """The members (indexes) whose workers are among these refit ranks (none if a trainer rank is)."""
        ranks = set(ranks or ())
        if not ranks or any(r < self.first_rank for r in ranks):
            return set()
        return {i for i, mine in enumerate(self.ranks()) if ranks & set(mine)}


def replica_bases(clients: list, dst) -> list[int]:
    """The layout replica each client's engine starts at (`Replicas.of`, which checks them against `dst`)."""
    return Replicas.of(clients, dst).bases


def fleet_layout(text: str, urls: list | None, replicas: int) -> str:
    """A fleet layout's YAML text for its members only (`layouts.layout.replicated_doc`): the
    `dp` of its mesh their replica count (added first where the layout has none: one replica), the replicas'
    own parallelism unchanged, and with `urls` its `engine.url` the members' URLs."""
    doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise ConfigError(f"expected a layout mapping, got {type(doc).__name__}", key="dst")
    return yaml.safe_dump(replicated_doc(doc, replicas, file="dst", urls=urls), sort_keys=False)
