"""The `reshard` trainer engine and its weight source: what `WeightTransferTrainerFactory.trainer_init` builds on
every trainer rank. Importing it needs vLLM (its base classes).

Every trainer rank joins the refit group; rank 0 drives vLLM's handshake through the client (init, start,
update, finish), running each blocking call beside its own part of the transfer, and one `Refit` in mode
reshard moves only the intersections (`path: full`: the baseline in `full`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from functools import partial as partial_call
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from reshard_cli import formats
from reshard_cli.base import checksums
from reshard_cli.engines.vllm import compat, full
from reshard_cli.base.ports import free_port
from reshard_cli.engines.vllm.clients import Call, control, fleet_layout
from reshard_cli.engines.fleet.handshake import (NUMBERS, digest, domain_key, handshake, layouts, rank_names,
                                                 refit_topology)
from reshard_cli.engines.vllm.plugin import ENGINE
from reshard_cli.engines.vllm.info import ReshardTrainerInitInfo
from reshard_cli.errors import ConfigError
from reshard_cli.plan.fleet import fleet_figures, fleet_of
from reshard_cli.plan.groups import resume_layer, stage_budget_mb
from reshard_cli.transfer.comm import refit_group
from reshard_cli.transfer.live import Refit, RefitFailed, progress
from reshard_cli.transfer.versions import held_by, label
from reshard_cli.transfer.watchdog import GroupBroken

_api = compat.transfer_api()


class UpdateFailed(RuntimeError):
    """An update that failed on some rank of the refit, the same line on every trainer rank. `committed` and
    `groups`: the staging groups the engine committed before the failure, and all of them; `group_broken`:
    the refit group was given up (a rank failed mid-transfer, died or stalled): trainer_init again."""

    def __init__(self, message: str, failure: RefitFailed):
        super().__init__(message)
        self.committed, self.groups, self.group_broken = failure.committed, failure.groups, failure.broken
        self.ranks = failure.ranks  # the refit ranks a broken group's line names (trainer r is refit rank r)
        self.held = failure.held  # every worker's refit rank -> the groups it committed, as it recorded them
        self.torn = failure.torn  # the workers whose commit failed part-way: they hold part of one more group
        self.line = failure.line  # what failed, without what it left the engine doing


class ReshardSource(_api.WeightSource):
    """The trainer's tensors by checkpoint name: DTensors as torch's parallelisms make them, or local
    views when a `src` layout says where they sit. `tensors` is called at every update."""

    def __init__(self, tensors: Callable[[], Mapping[str, torch.Tensor]]):
        self.tensors = tensors

    def metadata(self):
        return [compat.param_meta(n, x.dtype, tuple(x.shape)) for n, x in self.tensors().items()]

    def __iter__(self):
        for n, x in self.tensors().items():
            yield n, (x.full_tensor() if isinstance(x, DTensor) else x)


class ReshardTrainerEngine(_api.TrainerWeightTransferEngine):
    """Trainer side: every trainer rank joins the refit group; rank 0 drives vLLM's handshake through
    the client (an `LLM`, `HTTPVLLMWeightSyncClient`, or anything with the four methods), running each
    blocking call beside its own part of the transfer.

    A fleet: `client` may be a list, one client per engine (several servers or `LLM`s), whose replicas the
    layout's `dp` lists in order; each engine covers as many replicas as its client's `replicas` says (vLLM's
    data parallelism inside one server; `LLMClient` and `reshard run` set it), one otherwise. One refit then
    moves the weights into every replica: the trainer sends each byte once per NVLink domain (`topology`),
    the replicas of a domain forward the rest to each other."""

    init_info_cls = ReshardTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError("reshard: pass source= (a ReshardSource or vLLM's ModuleSource)")
        clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self = cls(client=clients[0], source=source, is_sender=init_info.is_sender)
        if init_info.on_partial not in ("pause", "serve"):
            raise ValueError(f"reshard: on_partial must be 'pause' or 'serve', not {init_info.on_partial!r}")
        if init_info.on_member_fault not in ("drop", "fail"):
            raise ValueError(f"reshard: on_member_fault must be 'drop' or 'fail', not {init_info.on_member_fault!r}")
        self._fleet_text = init_info.dst  # the layout as given: its replica is every member's
        self.version: str | None = None  # the last update's weight version (what a joining member catches up to)
        self._pending: list = []  # membership changes for the next update (rank 0): ("add" | "remove", client)
        self.events: list = []  # what happened to the membership, in order (the reports carry each update's)
        self._telling: dict = {}  # engine -> (thread, called off, lock): telling a member that did not answer
        # what it holds (`_tell_later`)
        self._form(init_info, clients if self.is_sender else [])
        return self

    def _form(self, init_info, clients: list) -> None:
        """Join the refit group with these clients' engines (rank 0; the other trainer ranks pass none) as the
        fleet: the layout's `dp` is theirs (`init_info.dst`)."""
        self.clients = clients
        self.info, self._fleet_figures = init_info, None
        self._silent: set = set()  # engines that did not answer when the last update failed: told on a thread
        self._left_open: set = set()  # engines whose update session a previous trainer left open (handshake)
        trainer_size = dist.get_world_size() if dist.is_initialized() else 1
        src, dst = layouts(init_info.src, init_info.dst, trainer_size)
        trainer_size = src.size if src is not None else trainer_size
        world = init_info.world_size or trainer_size + dst.size
        refit_topology(init_info.topology, [])  # a bad topology fails here, on every trainer rank, before any call
        worker_info = _worker_info(init_info, world, trainer_size)
        try:
            bases, refused = replica_bases(self.clients, dst) if self.is_sender else [], None
        except ConfigError as e:  # no engine is called; the other trainer ranks learn it as they join
            bases, refused = [], str(e)
        # the workers' init calls block until the group forms: run them beside this rank's own joining
        calls = [Call(c.init_weight_transfer_engine, {**worker_info, "replica": first})
                 for c, first in zip(self.clients, bases)]
        tensors = self._tensors()
        try:
            self.group = refit_group(init_info.host, init_info.port, init_info.rank, world,
                                     timeout=init_info.timeout, device=_device_of(tensors),
                                     abort=lambda: refused or next((f for f in (c.failure() for c in calls) if f),
                                                                   None),
                                     names=rank_names(dst, ENGINE), stall=init_info.stall or None)
        except BaseException:
            for call in calls:  # the workers' init ends with the group's failure (its store gone)
                call.join(timeout=5, quiet=True)
            raise
        error = _own_error(src, tensors, init_info.rank)
        try:
            stage_budget_mb(dst, init_info.stage_mb)
        except ConfigError as e:
            error = error or str(e)
        try:
            agreed = handshake(self.group, f"trainer {init_info.rank}",
                               digest(src, None if src is not None or error else tensors), error,
                               domain_key(init_info.topology, _device_of(tensors)))
            topology = refit_topology(init_info.topology, agreed.domains)
        except BaseException:
            for call in calls:
                call.join(timeout=init_info.timeout, quiet=True)
            self.shutdown()
            raise
        for call in calls:
            call.join(timeout=init_info.timeout)
        self.src, self.dst = src, dst
        self._trainer_size = trainer_size
        open_ranks = {r for r, is_open in enumerate(agreed.open_updates) if is_open}
        self._left_open = {_engine_key(c) for c, ranks in zip(self.clients, self._member_ranks())
                           if open_ranks & set(ranks)}
        self.refit = (Refit(role="src", src=src, dst=dst, mode=init_info.mode, topology=topology,
                            bucket_mb=init_info.bucket_mb, group=self.group,
                            stage_mb=stage_budget_mb(dst, init_info.stage_mb), who=f"trainer {init_info.rank}")
                      if init_info.path == "reshard" else None)

    def fleet_figures(self) -> dict | None:
        """What one refit of the whole fleet moves beside one refit per replica and the full-tensor baseline
        (`plan.fleet.fleet_figures`); None before the first refit or on the full path."""
        if self._fleet_figures is None and self.refit is not None and self.refit.plan is not None:
            self._fleet_figures = fleet_figures(self.refit.plan, fleet_of(self.refit.plan.dst))
        return self._fleet_figures

    def _tensors(self) -> Mapping[str, torch.Tensor]:
        src = self.source
        if hasattr(src, "tensors"):
            return src.tensors()
        params = compat.module_source_params(src)
        if params is None:
            raise ValueError("reshard: the source must be a ReshardSource or vLLM's ModuleSource")
        return params

    # ------------------------------------------------------------------------------------------ membership

    def add(self, client, weight_version: str | None = None) -> None:
        """A member joins the fleet (rank 0 passes its client; every trainer rank calls it, the others with
        None): it catches up at once, from the trainer's current weights, in a refit of that member alone (the
        others keep serving, untouched), and is part of the fleet's refit from the next update on. Collective
        over the trainer's ranks. Its weight version is `weight_version`, the name of the weights it is sent;
        without one, the last update's, which is right only while the trainer's weights are still that
        update's: after an optimizer step since (a tensor changed in place) the call is refused before
        anything moves."""
        if weight_version is None:
            changed = self._share(self._stepped() if self.is_sender else None)
            if changed:
                raise ConfigError(f"the trainer's weights changed since the last update ({self.version}): pass "
                                  f"add(client, weight_version=...) naming the weights the new member is sent",
                                  key="weight_version")
            weight_version = self.version
        if self.is_sender:
            self._call_off(client)
        port, replicas = self._share([free_port(), getattr(client, "replicas", None) or 1]
                                     if self.is_sender else None)
        t0 = time.perf_counter()
        solo = type(self).trainer_init(
            replace(self.info, port=port, dst=fleet_layout(self._fleet_text, None, replicas)),
            client=[client] if self.is_sender else [None], source=self.source)
        try:
            report = solo.send_weights(weight_version)
        finally:
            solo.shutdown()
        if self.is_sender:
            self._pending.append(("add", client))
        self.events.append({"event": "added", "member": _name(client), "catch_up_seconds":
                            round(time.perf_counter() - t0, 3), "resent_bytes": report["wire_bytes"],
                            "weight_version": weight_version})

    def _stepped(self) -> bool:
        """Whether any of this rank's tensors changed since the last update sent them (their in-place version
        counters moved: an optimizer step); False before the first update (no version to keep)."""
        sent = getattr(self, "_sent", None)
        return sent is not None and _versions(self._tensors()) != sent

    def remove(self, client) -> None:
        """A member leaves the fleet at the next update (rank 0; the engine keeps what it holds)."""
        if self.is_sender:
            self._pending.append(("remove", client))

    def send_weights(self, weight_version: str | None = None) -> dict:
        """One refit into every member of the fleet (membership changed since the last one re-forms the refit
        group and re-plans first). A member whose engine fails, dies or stalls during it is dropped with
        `on_member_fault: drop` (the default): the others form a new group with a new plan (forwarding among
        themselves) and the update resumes from the group that failed: the groups every survivor committed are
        not sent again. The report names the dropped member, why, and the groups it held (`dropped`); `fail`
        raises as one update."""
        self._apply_membership()
        t0 = time.perf_counter()
        dropped: list = []
        down = self._start_all()  # rank 0 starts every member's update; one that does not answer is a fault
        if down:
            if self.info.on_member_fault != "drop" or len(down) == len(self._share(
                    [_name(c) for c in self.clients] if self.is_sender else None)):
                raise RuntimeError(f"reshard: {'; '.join(down.values())}")
            dropped = [{"member": m, "why": why, "held_groups": 0} for m, why in down.items()]
            self._reform([c for c in self.clients if _name(c) not in down] if self.is_sender else [])
        resume, resumed, started = None, None, not down
        while True:
            try:
                report = self._update(weight_version, started=started, resume_layer=resume)
                break
            except UpdateFailed as e:
                gone = self._faulty(e)
                if not gone or self.info.on_member_fault != "drop":
                    raise  # not a member's fault, or no member would be left: the update failed
                resumed = resumed or time.perf_counter()
                lost, layer = self._share(self._resume_point(e, gone) if self.is_sender else None)
                # what the survivors committed before a resumed attempt failed too stays theirs
                resume = max((r for r in (resume, layer) if r is not None), default=None)
                dropped += [{"member": m, "why": e.line, "held_groups": held} for m, held in lost]
                self._reform([c for i, c in enumerate(self.clients) if i not in gone] if self.is_sender else [],
                             fresh_port=True)
                started = False
        if resumed is not None:
            report["resent_bytes"] = report["wire_bytes"]  # the survivors' groups from the failed one on
            report["drop_and_resume_seconds"] = round(time.perf_counter() - resumed, 3)
        report["resumed_from_group"] = report["trainer"].get("first_group", 0)  # of the survivors' groups
        report["resumed_from_layer"] = resume
        report["dropped"] = dropped
        self.events += [{"event": "dropped", **d} for d in dropped]
        report["members"] = self._share([_name(c) for c in self.clients] if self.is_sender else None)
        report["seconds_with_membership"] = round(time.perf_counter() - t0, 3)
        self.version = report["weight_version"]
        self._sent = _versions(self._tensors())  # what `add` compares with
        return report

    def _resume_point(self, failure: "UpdateFailed", gone: set) -> tuple[list, int | None]:
        """Rank 0, after a failure that dropped the members `gone`: each one's (name, groups its workers all
        committed), and the layer the survivors resume from (None: from the start): the one after the groups
        every survivor's worker committed (a worker that recorded nothing committed none of this update). In
        layers: the survivors' own plan may group them otherwise (experts spread over fewer replicas)."""
        per = fleet_of(self.dst).per_replica
        held, first, out = failure.held or {}, len(failure.groups), []
        base = self._trainer_size
        for i, client in enumerate(self.clients):
            n = (getattr(client, "replicas", None) or 1) * per
            mine = [held.get(r, 0) for r in range(base, base + n)]
            base += n
            if i in gone:
                out.append((_name(client), min(mine)))
            else:
                first = min(first, *mine)
        return out, resume_layer(failure.groups[:first])

    def _share(self, value):
        """`value` from trainer rank 0 on every trainer rank: through the refit group's store while the group is
        up (a trainer rank that died or stalled is named by its watchdog, not waited for), else over the
        trainer's own process group (after a failure that named engines, not trainer ranks)."""
        if self._trainer_size <= 1:
            return value
        if getattr(self, "group", None) is not None:
            return self.group.share(value, 0)
        box = [value]
        dist.broadcast_object_list(box, 0)
        return box[0]

    def _answering(self) -> list:
        """The clients to call: all but those the last update's failure named dead or stalled."""
        silent = getattr(self, "_silent", set())
        return [c for c in getattr(self, "clients", []) if _engine_key(c) not in silent]

    def _start_all(self) -> dict:
        """vLLM's start_weight_update on every member (rank 0), shared with every trainer rank: {member: why}
        of those that did not answer."""
        down = {}
        if self.is_sender:
            for client in self.clients:
                try:
                    self._start_update(client)
                except Exception as e:  # noqa: BLE001 - an HTTP error, a refused connection, a dead LLM
                    down[_name(client)] = f"{_name(client)} did not start the update ({type(e).__name__}: {e})"
        return self._share(down if self.is_sender else None)

    def _apply_membership(self) -> None:
        """The changes `add` and `remove` asked for: the group formed again for the members (collective)."""
        pending = self._share([(k, i) for k, i in ((k, id(c)) for k, c in self._pending)]
                         if self.is_sender else None)
        if not pending:
            return
        members = list(self.clients)
        for kind, client in self._pending:
            if kind == "add" and all(c is not client for c in members):
                members.append(client)
            elif kind == "remove":
                members = [c for c in members if c is not client]
        self._pending = []
        self._reform(members)

    def _reform(self, members: list, *, fresh_port: bool = False) -> None:
        """Leave the refit group and form it again with `members` (rank 0's clients; [] elsewhere), the layout's
        replica times theirs, on the same host and port (`fresh_port`: another one, after a broken group,
        whose store may still hold its port while a dead peer's connections time out)."""
        counts, port = self._share(([getattr(c, "replicas", None) or 1 for c in members],
                                                   free_port() if fresh_port else self.info.port)
                              if self.is_sender else None)
        if not counts:
            raise RuntimeError("reshard: no member of the fleet is left")
        self.shutdown()
        self._form(replace(self.info, port=port, dst=fleet_layout(self._fleet_text, None, sum(counts))), members)

    def _faulty(self, failure: "UpdateFailed") -> set:
        """The members (indexes into `clients`) a failed update's line names, the same on every trainer rank:
        the engines whose workers' refit ranks failed, died or stalled. Empty when it names a trainer rank,
        nothing, or every member (the update failed as a whole)."""
        if not failure.ranks or any(r < self._trainer_size for r in failure.ranks):
            return set()  # a trainer rank's fault (or none named): not a member's; no trainer rank waits on it
        gone = self._members_of(failure.ranks) if self.is_sender else None
        if gone is not None and len(gone) == len(self.clients):
            gone = set()  # no member would be left: the update failed as a whole
        return self._share(gone)

    def _members_of(self, ranks) -> set:
        """Rank 0: the members whose workers are among these refit ranks (none if a trainer rank is)."""
        ranks = set(ranks or ())
        if not ranks or any(r < self._trainer_size for r in ranks):
            return set()
        return {i for i, mine in enumerate(self._member_ranks()) if ranks & set(mine)}

    def _member_ranks(self) -> list[range]:
        """Rank 0: each member's workers, as refit ranks (its replicas' ranks, after the trainer's)."""
        per = fleet_of(self.dst).per_replica
        out, first = [], self._trainer_size
        for client in self.clients:
            n = (getattr(client, "replicas", None) or 1) * per
            out.append(range(first, first + n))
            first += n
        return out

    def _update(self, weight_version: str | None = None, *, started: bool = False,
                resume_layer: int | None = None) -> dict:
        """One refit into the engines; every worker's numbers and this rank's, as a dict (`started`: vLLM's
        start_weight_update already called on every client; `resume_layer`: the engines hold what is outside
        the decoder layers and the layers before it already, `Refit.__call__`). Each engine's weight version
        becomes `weight_version` when every group was committed, stays when none was, and otherwise says what
        it holds (`transfer.versions.label`: partial, or mixed where its workers may differ). A failure raises
        one line on every trainer rank, after every engine that answers has been told to finish the update
        (labelled, paused per `on_partial`); one that does not answer is told when it does (`_tell_later`)."""
        if self.group is None:
            raise RuntimeError("reshard: the refit group was given up after a failure: trainer_init again")
        tensors = self._tensors()
        calls = []
        if self.is_sender:
            for client in self.clients if not started else ():
                self._start_update(client)
            calls = [Call(c.update_weights, {"verify": self.info.verify, "resume_layer": resume_layer})
                     for c in self.clients]
        t0 = time.perf_counter()
        failure, everyone, mine = self._run(tensors, resume_layer)
        late = self._join(calls, failure) if self.is_sender else set()
        seconds = time.perf_counter() - t0
        workers = [s for s in everyone if s is not None and "worker" in s]
        trainers = [s for s in everyone if s is not None and "trainer" in s]
        failed = next((w for w in workers if w["error"]), None)
        held = failure.held if failure is not None else self.refit.held() if self.refit is not None else {}
        states = self._states(failure, late) if failure is not None and self.is_sender else {}
        if failure is not None and held:  # what every worker holds, as each recorded it (the same on every rank)
            failure.committed = failure.groups[:min(held.values())]
        labels = {i: weight_version if failure is None else label(weight_version, h) for i, h in
                  (states.items() if failure is not None else enumerate(self.clients))}
        paused = self._tell(calls, labels, states, late, complete=failure is None and failed is None) \
            if self.is_sender else False
        if failure is not None:
            if failure.broken:  # the group is given up: the next refit needs a new trainer_init
                self.shutdown()
            raise UpdateFailed(self._failure_line(failure, paused), failure) from None
        if failed:
            raise RuntimeError(f"reshard: refit rank {failed['worker']} (vLLM worker): {failed['error']}")
        return {"seconds": seconds, "trainer": mine, "trainers": trainers, "workers": workers,
                "weight_version": weight_version, "held": held, **fleet_report(trainers, workers),
                "fleet": self.fleet_figures() if self.is_sender else None}

    def _run(self, tensors, resume_layer: int | None) -> tuple:
        """This rank's part of the update, then every rank's numbers: (the failure or None, the numbers, this
        rank's)."""
        failure: RefitFailed | None = None
        everyone, mine = [], {"bytes_sent": 0, "checksums_ok": None}
        try:
            mine = self._send(tensors, resume_layer)
        except RefitFailed as e:  # the same line on every rank that saw it
            failure = e
        except GroupBroken as e:  # a rank died or stalled outside the groups (the full path)
            failure = RefitFailed(str(e), [], [], broken=True, ranks=e.ranks)
        if failure is None or not failure.broken:
            try:  # every rank's numbers, the workers' after their update
                everyone = self.group.all_gather_object({"trainer": self.info.rank, **mine}, what=NUMBERS)
            except GroupBroken as e:  # after the update: what it committed stays committed
                groups = self.refit.groups if self.refit is not None else []
                done = groups if failure is None else failure.committed
                failure = RefitFailed(f"{e} (after the update)", done, groups, broken=True, ranks=e.ranks,
                                      line=f"{e} (after the update)")
        if failure is not None and self.refit is not None:
            failure.held, failure.torn = self.refit.held(), self.refit.torn()
        return failure, everyone, mine

    def _join(self, calls: list, failure: RefitFailed | None) -> set:
        """Wait for the members' update calls (rank 0); the members whose call has not returned: those a broken
        group's line names are given a few seconds (a stopped server answers no call), the others the group's
        timeout. They are told what they hold when they answer (`_tell_later`), not called meanwhile."""
        named = self._members_of(failure.ranks) if failure is not None and failure.broken else set()
        for i, call in enumerate(calls):
            call.join(timeout=min(5.0, self.info.timeout) if i in named else self.info.timeout, quiet=True)
        late = {i for i, call in enumerate(calls) if call.thread.is_alive()}
        self._silent = {_engine_key(self.clients[i]) for i in late}
        return late

    def _states(self, failure: RefitFailed, late: set) -> dict:
        """Rank 0, after a failure: what each member holds (`transfer.versions.Held`) from what its workers
        recorded; a member that did not answer may have committed up to the last group whose agreement passed
        (this rank's failing group: it took part in every agreement)."""
        n, upto = len(failure.groups), len(failure.committed)
        return {i: held_by(list(ranks), failure.held, failure.torn, n, upto=upto if i in late else None)
                for i, ranks in enumerate(self._member_ranks())}

    def _failure_line(self, failure: RefitFailed, paused: bool) -> str:
        """The line every trainer rank raises (from what every worker recorded, the same on each): what failed,
        then what the engines hold."""
        if not failure.torn and len(set(failure.held.values())) <= 1:
            where = progress(failure.groups, len(failure.committed))
        else:
            names, n = rank_names(self.dst, ENGINE), len(failure.groups)
            held = [f"{names(r)}: {k}" + (f" and part of {failure.groups[k].label}" if r in failure.torn and k < n
                                          else "") for r, k in sorted(failure.held.items())]
            where = (f"the workers hold different groups of {n} ({', '.join(held)}); each engine's weight version "
                     f"says what it holds; the next refit repairs it")
        note = ("; the engine is paused until a complete refit lands (on_partial: serve keeps it serving)"
                if paused else "")
        return f"reshard: {failure.line}; {where}{note}"

    def _tell(self, calls: list, labels: dict, states: dict, late: set, *, complete: bool) -> bool:
        """Rank 0: every member that answered finishes the update, labelled with what it holds (its prefix cache
        dropped if anything changed), paused after a partial one (`on_partial: pause`) or resumed after a
        complete one; the others are told when they answer. Whether any member is paused now."""
        for i, client in enumerate(self.clients):
            held = states.get(i)
            partial = held is not None and held.partial
            if i in late:
                self._tell_later(client, calls[i], labels.get(i), partial=partial)
                continue
            # after a failure, an engine that is gone refuses the finish and says nothing new
            finish = self._finish_update if complete else partial_call(_quietly, self._finish_update)
            finish(client, labels.get(i), changed=complete or (held is not None and held.hi > 0))
            self._pause_or_resume(client, partial=partial, complete=complete)
        return any(_engine_key(c) in _PAUSED for c in self.clients)

    def _tell_later(self, client, call: Call, version: str | None, *, partial: bool) -> None:
        """A member that did not answer when the update failed (a stopped server, a worker still busy): on a
        thread of its own, once its update call returns (within the group's timeout), it is told as the others
        were: finished, labelled, paused per `on_partial`, and its transfer engine shut down (its group is
        gone). One that never answers keeps its session open: a later `trainer_init` (or `add`) finds it open
        in the handshake and finishes it first; `add` also calls the telling off (`_call_off`). `settle()`
        waits for these."""
        key, off, lock = _engine_key(client), threading.Event(), threading.Lock()

        def tell():
            call.join(timeout=self.info.timeout, quiet=True)
            with lock:
                if off.is_set() or call.thread.is_alive():
                    why = "added again first" if off.is_set() else f"no answer within {self.info.timeout:.0f} s"
                    self.events.append({"event": "not told", "member": _name(client), "why": why})
                    return
                _quietly(self._finish_update, client, version, changed=version is not None)
                _quietly(self._pause_or_resume, client, partial=partial, complete=False)
                _quietly(control, client, "shutdown_weight_transfer_engine")
            self.events.append({"event": "told", "member": _name(client), "weight_version": version,
                                "paused": key in _PAUSED})
        thread = threading.Thread(target=tell, daemon=True, name=f"reshard-tell-{_name(client)}")
        self._telling[key] = (thread, off, lock)
        thread.start()

    def _call_off(self, client) -> None:
        """A member being added again: its pending telling (`_tell_later`) is called off, after any call it is
        making now, so it cannot finish or shut down the new member's session."""
        thread, off, lock = self._telling.pop(_engine_key(client), (None, None, None))
        if thread is not None:
            off.set()
            with lock:
                pass

    def settle(self, timeout: float | None = None) -> bool:
        """Wait for the members being told after a failure (`_tell_later`); whether all were."""
        deadline = None if timeout is None else time.monotonic() + timeout
        threads = [t for t, _off, _lock in getattr(self, "_telling", {}).values()]
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def _pause_or_resume(self, client, *, partial: bool, complete: bool) -> None:
        """After an update that left an engine on a mix of two steps: pause its generation (vLLM's pause route,
        requests kept queued) unless `on_partial: serve`; after a complete one: resume it if reshard paused it
        (a failure that committed nothing leaves it as it was: still a mix)."""
        key = _engine_key(client)
        if partial and self.info.on_partial == "pause":
            if key not in _PAUSED and _quietly(control, client, "pause", "mode=keep"):
                _PAUSED.add(key)
        elif complete and key in _PAUSED:
            _quietly(control, client, "resume")
            _PAUSED.discard(key)

    def _finish_update(self, client, version: str | None, *, changed: bool) -> None:
        """The engine's finish_weight_update with its new weight version (None: unchanged), and what a changed
        model needs: the prefix cache dropped (the KV of earlier prompts was computed with the old weights, and
        vLLM does not drop it on a weight update). Every worker's session is open until here (the workers never
        end it themselves); an engine that refuses the finish anyway gets the version on its own."""
        try:
            client.finish_weight_update(version)
        except Exception:  # noqa: BLE001 - vLLM's RuntimeError, or an HTTP error carrying it
            setter = getattr(client, "update_weight_version", None)
            if version is not None and setter is not None:
                setter(version)
        if changed:  # the client's own method, or the server's route through vLLM's HTTP client's base_url
            control(client, "reset_prefix_cache")

    def _start_update(self, client) -> None:
        """The engine's start_weight_update. A session the handshake found open (a trainer that died before
        finishing its update) is finished first: vLLM refuses to start one while another is open, on every
        worker, and its replies would then pair with the next call's."""
        key = _engine_key(client)
        if key in self._left_open:
            self._left_open.discard(key)
            _quietly(client.finish_weight_update, None)
        try:
            client.start_weight_update()
        except Exception:  # noqa: BLE001 - vLLM's RuntimeError, or an HTTP 500 carrying it
            _quietly(client.finish_weight_update, None)
            client.start_weight_update()

    def _send(self, tensors: Mapping[str, torch.Tensor], resume_layer: int | None = None) -> dict:
        """This rank's part of one update: the refit (resumed at `resume_layer`), or the full path's tensors."""
        if self.refit is not None:
            rs = self.refit(tensors, verify_checksums=self.info.verify, resume_layer=resume_layer)
            return {"bytes_sent": rs.bytes_sent, "checksums_ok": rs.checksums_ok, "groups": rs.groups,
                    "first_group": rs.first_group, "seconds": rs.seconds}
        sent = full.send_full(self.group, tensors, self.src, self.dst, self.info.rank)
        return {"bytes_sent": sent, "checksums_ok": None}

    def shutdown(self) -> None:
        """End the refit group on this rank (its process groups, threads and, on rank 0, its store and port) and,
        on the rank that drives the engines, theirs (vLLM's shutdown_weight_transfer_engine): `trainer_init`
        may then run again in this process, on the same host and port."""
        if getattr(self, "group", None) is not None:
            self.group.close()
            for client in self._answering():
                _quietly(control, client, "shutdown_weight_transfer_engine")
        self.refit = self.group = None


def fleet_report(trainers: list[dict], workers: list[dict]) -> dict:
    """One update's bytes as the fleet saw them: sent by the trainer (`wire_bytes`), forwarded between the
    engine's workers, landed in each; and per replica its workers' checksums (equal, position by position, on
    every replica that holds the same weights) and its slowest worker's time."""
    replicas: dict[int, list] = {}
    for w in sorted(workers, key=lambda w: w["worker"]):
        replicas.setdefault(w.get("replica", 0), []).append(w)
    rows = [{"replica": r, "workers": [w["worker"] for w in ws],
             "landed_bytes": sum(w.get("bytes_received", 0) for w in ws),
             "forwarded_bytes": sum(w.get("forwarded_bytes", 0) for w in ws),
             "checksums": [checksums.fmt(w["checksum"]) if w.get("checksum") is not None else None for w in ws],
             "checksums_ok": all(w.get("checksums_ok") for w in ws),
             "seconds": max((w.get("seconds", 0.0) for w in ws), default=0.0),
             "processing_seconds": max((w.get("processing_seconds") or 0.0 for w in ws), default=0.0)}
            for r, ws in sorted(replicas.items())]
    return {"wire_bytes": sum(t.get("bytes_sent", 0) for t in trainers),
            "forwarded_bytes": sum(r["forwarded_bytes"] for r in rows),
            "landed_bytes": sum(r["landed_bytes"] for r in rows), "replicas": rows,
            "replicas_identical": len({tuple(r["checksums"]) for r in rows}) <= 1 and
            all(c is not None for r in rows for c in r["checksums"])}


def replica_bases(clients: list, dst) -> list[int]:
    """The layout replica each client's engine starts at: the replicas of the clients before it. A client says
    how many it drives with `replicas` (one without; a single client without it drives the whole layout). More
    or fewer than the layout's `dp` is one ConfigError, before any engine is called."""
    fleet = fleet_of(dst)
    if len(clients) == 1 and getattr(clients[0], "replicas", None) is None:
        return [0]
    counts = [int(getattr(c, "replicas", None) or 1) for c in clients]
    if sum(counts) != fleet.replicas:
        raise ConfigError(f"the layout has {fleet.replicas} replica(s) (dp {fleet.replicas}), the {len(clients)} "
                          f"engine client(s) drive {sum(counts)} ({' + '.join(map(str, counts))})", key="dst")
    return [sum(counts[:i]) for i in range(len(counts))]


def _own_error(src, tensors: Mapping[str, torch.Tensor], rank: int) -> str | None:
    """This trainer rank's own checks before the handshake: the vLLM version, and with a `src` layout, its
    tensors bound by the layout's format (a framework's own parameters checked against it) and every tensor
    the layout puts here present."""
    try:
        compat.check_version()
        named = tensors
        if src is not None:
            fmt = formats.get(src.format)
            if fmt.bind is not None:
                named = fmt.bind(tensors, src, rank)
    except ConfigError as e:
        return str(e)
    if src is None:
        return None
    held = {src.manifest.tensors[t].name for t, box in src.held(rank) if box.numel}
    missing = sorted(held - set(named))
    return f"the trainer does not hold {missing[0]!r}" if missing else None


def _name(client) -> str:
    """A member as the reports name it: its server's URL, else its client."""
    return str(getattr(client, "base_url", None) or getattr(client, "name", None) or client)


_PAUSED: set = set()  # the engines reshard paused after a partial update, until a complete one (across
# trainer_init: the engine stays paused when the trainer joins a new group after a failure); only what reshard
# paused is resumed


def _engine_key(client):
    """An engine by its server's URL (a new client of the same server is the same engine), else its client."""
    return getattr(client, "base_url", None) or id(client)


def _quietly(fn, *args, **kwargs):
    """A control-plane call whose failure is expected and says nothing new (a finish where vLLM already ended
    the update); its result, None after a failure."""
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001
        return None


def _versions(tensors: Mapping[str, torch.Tensor]) -> dict:
    """Each tensor's in-place version counters (a DTensor's own, which an optimizer step on it moves, and its
    local shard's, which an in-place change of the shard moves)."""
    return {n: (x._version, x._local_tensor._version) if isinstance(x, DTensor) else x._version
            for n, x in tensors.items()}


def _worker_info(init_info, world: int, trainer_size: int) -> dict:
    """What every engine worker's `init_weight_transfer_engine` is given (its replica's first rank is added per
    engine): where the refit group meets, its size, the layouts and the refit's settings."""
    return {"host": init_info.host, "port": init_info.port, "world_size": world, "src": init_info.src,
            "dst": init_info.dst, "trainer_size": trainer_size, "timeout": init_info.timeout,
            "bucket_mb": init_info.bucket_mb, "path": init_info.path, "stage_mb": init_info.stage_mb,
            "topology": init_info.topology, "mode": init_info.mode, "stall": init_info.stall}


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    return next((x.device for x in tensors.values()), torch.device("cpu"))
