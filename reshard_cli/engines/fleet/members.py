"""A fleet's members, whatever the engine: membership changes between updates (`add` catches a new member up
from the trainer's current weights, `remove`), drop-and-resume (a member whose engine fails, dies or stalls
mid-update is dropped and the others resume from the group that failed), and telling every member what it
holds after a failure (labelled, paused, told later when it answers late).

An engine plugs in twice: its trainer engine mixes in `FleetTrainer` (vLLM's: `engines.vllm.trainer`), and
its clients are reached through a `client.Member` of its own (vLLM's: `engines.vllm.clients.VLLMMember`)."""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from functools import partial as partial_call
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from reshard_cli.base import checksums
from reshard_cli.base.ports import free_port
from reshard_cli.engines.fleet.client import Call, Member
from reshard_cli.engines.fleet.handshake import rank_names
from reshard_cli.engines.fleet.replicas import Replicas, fleet_layout, replicas_of
from reshard_cli.errors import ConfigError
from reshard_cli.plan.groups import resume_layer
from reshard_cli.transfer.live import RefitFailed, progress
from reshard_cli.transfer.versions import held_by, label


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


PAUSED: set = set()  # the engines reshard paused after a partial update, until a complete one (across
# trainer_init: the engine stays paused when the trainer joins a new group after a failure); only what reshard
# paused is resumed


FLEET_SETTINGS = {"on_partial": ("pause", "serve"), "on_member_fault": ("drop", "fail")}


def checked_fleet_settings(info) -> None:
    """The fleet's settings of a trainer's init info (any engine's), refused in one line naming the key: the one
    check, made when the info is built (the vLLM backend's `__post_init__`) and when a fleet starts."""
    for key, allowed in FLEET_SETTINGS.items():
        if getattr(info, key) not in allowed:
            raise ConfigError(f"must be {' or '.join(map(repr, allowed))}, not {getattr(info, key)!r}", key=key)


class FleetTrainer:
    """The fleet's side of a trainer engine: mixed into an engine's trainer engine (`engines.vllm.trainer`),
    which provides:

      member        its `Member` class (how the fleet reaches one of its clients)
      engine_name   what lines call its ranks ("vLLM": "vLLM replica 1 worker 0")
      trainer_init(init_info, client=, source=)  a ready engine (classmethod; `add` builds a member's alone)
      _form(init_info, clients)  join the refit group with these clients' engines as the fleet (calling
                    `_seat` first, `_seated` once the handshake is through)
      _update(version, started=, resume_layer=)  one refit into the members (calling `_start_update`,
                    `_join` and `_tell_outcome`), its report
      _tensors()    the trainer's tensors by name; shutdown(): leave the refit group
    and the attributes `info` (its trainer init info: `port`, `timeout`, `on_partial`, `on_member_fault`),
    `group` (the refit group), `dst` (the fleet's layout), `source` and `is_sender`."""

    member: type[Member] = Member
    engine_name: str = "engine"

    def _fleet_init(self, init_info) -> None:
        """The fleet's settings checked, its state empty (`trainer_init`, before the group forms)."""
        checked_fleet_settings(init_info)
        self._fleet_text = init_info.dst  # the layout as given: its replica is every member's
        self.version: str | None = None  # the last update's weight version (what a joining member catches up to)
        self._pending: list = []  # membership changes for the next update (rank 0): ("add" | "remove", client)
        self.events: list = []  # what happened to the membership, in order (the reports carry each update's)
        self._telling: dict = {}  # engine -> (thread, called off, lock): telling a member that did not answer
        # what it holds (`_tell_later`)

    def _seat(self, clients: list) -> None:
        """The members of the group being formed: rank 0's clients (the other trainer ranks pass none)."""
        self.clients = clients
        self._silent: set = set()  # engines that did not answer when the last update failed: told on a thread
        self._left_open: set = set()  # engines whose update session a previous trainer left open (handshake)

    def _place_members(self, dst, first_rank: int) -> str | None:
        """Which replicas and refit ranks each member drives (`Replicas`, rank 0; none elsewhere); why the
        clients do not fit the layout, if they do not (no engine is called; the other ranks learn it as they
        join)."""
        self._replicas = Replicas.none(dst, first_rank)
        if not self.is_sender:
            return None
        try:
            self._replicas = Replicas.of(self.clients, dst, first_rank)
        except ConfigError as e:
            return str(e)
        return None

    def _seated(self, open_updates: list) -> None:
        """After the handshake: the members whose update session a previous trainer left open (some worker of
        theirs said so), to be finished before their next start."""
        open_ranks = {r for r, is_open in enumerate(open_updates) if is_open}
        self._left_open = {self.member(c).key for c, ranks in zip(self.clients, self._replicas.ranks())
                           if open_ranks & set(ranks)}

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
        port, replicas = self._share([free_port(), replicas_of(client)] if self.is_sender else None)
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
        self.events.append({"event": "added", "member": self._name(client), "catch_up_seconds":
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
                    [self._name(c) for c in self.clients] if self.is_sender else None)):
                raise RuntimeError(f"reshard: {'; '.join(down.values())}")
            dropped = [{"member": m, "why": why, "held_groups": 0} for m, why in down.items()]
            self._reform([c for c in self.clients if self._name(c) not in down] if self.is_sender else [])
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
        report["members"] = self._share([self._name(c) for c in self.clients] if self.is_sender else None)
        report["seconds_with_membership"] = round(time.perf_counter() - t0, 3)
        self.version = report["weight_version"]
        self._sent = _versions(self._tensors())  # what `add` compares with
        return report

    def _resume_point(self, failure: UpdateFailed, gone: set) -> tuple[list, int | None]:
        """Rank 0, after a failure that dropped the members `gone`: each one's (name, groups its workers all
        committed), and the layer the survivors resume from (None: from the start): the one after the groups
        every survivor's worker committed (a worker that recorded nothing committed none of this update). In
        layers: the survivors' own plan may group them otherwise (experts spread over fewer replicas)."""
        held, first, out = failure.held or {}, len(failure.groups), []
        for i, (client, ranks) in enumerate(zip(self.clients, self._replicas.ranks())):
            mine = [held.get(r, 0) for r in ranks]
            if i in gone:
                out.append((self._name(client), min(mine)))
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

    def _name(self, client) -> str:
        """A member as the reports name it (`Member.name`)."""
        return self.member(client).name

    def _answering(self) -> list:
        """The clients to call: all but those the last update's failure named dead or stalled."""
        silent = getattr(self, "_silent", set())
        return [c for c in getattr(self, "clients", []) if self.member(c).key not in silent]

    def _leave_members(self) -> None:
        """Rank 0, leaving the refit group: every member that answers ends its side of it."""
        for client in self._answering():
            _quietly(self.member(client).shutdown)

    def _start_all(self) -> dict:
        """The engine's start of an update on every member (rank 0), shared with every trainer rank: {member:
        why} of those that did not answer."""
        down = {}
        if self.is_sender:
            for client in self.clients:
                try:
                    self._start_update(client)
                except Exception as e:  # noqa: BLE001 - an HTTP error, a refused connection, a dead engine
                    name = self._name(client)
                    down[name] = f"{name} did not start the update ({type(e).__name__}: {e})"
        return self._share(down if self.is_sender else None)

    def _start_update(self, client) -> None:
        """A member's start of an update (`Member.start`). A session the handshake found open (a trainer that
        died before finishing its update) is finished first: an engine refuses to start one while another is
        open, on every worker, and its replies would then pair with the next call's."""
        member = self.member(client)
        if member.key in self._left_open:
            self._left_open.discard(member.key)
            _quietly(member.finish, None, changed=False)
        member.start()

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
        replicas, port = self._share((sum(replicas_of(c) for c in members),
                                      free_port() if fresh_port else self.info.port) if self.is_sender else None)
        if not replicas:
            raise RuntimeError("reshard: no member of the fleet is left")
        self.shutdown()
        self._form(replace(self.info, port=port, dst=fleet_layout(self._fleet_text, None, replicas)), members)

    def _faulty(self, failure: UpdateFailed) -> set:
        """The members (indexes into `clients`) a failed update's line names, the same on every trainer rank:
        the engines whose workers' refit ranks failed, died or stalled. Empty when it names a trainer rank,
        nothing, or every member (the update failed as a whole)."""
        if not failure.ranks or any(r < self._trainer_size for r in failure.ranks):
            return set()  # a trainer rank's fault (or none named): not a member's; no trainer rank waits on it
        gone = self._replicas.members_of(failure.ranks) if self.is_sender else None
        if gone is not None and len(gone) == len(self.clients):
            gone = set()  # no member would be left: the update failed as a whole
        return self._share(gone)

    # ------------------------------------------------------------------------ after an update: telling members

    def _join(self, calls: list, failure: RefitFailed | None) -> set:
        """Wait for the members' update calls (rank 0); the members whose call has not returned: those a broken
        group's line names are given a few seconds (a stopped server answers no call), the others the group's
        timeout. They are told what they hold when they answer (`_tell_later`), not called meanwhile."""
        named = self._replicas.members_of(failure.ranks) if failure is not None and failure.broken else set()
        for i, call in enumerate(calls):
            call.join(timeout=min(5.0, self.info.timeout) if i in named else self.info.timeout, quiet=True)
        late = {i for i, call in enumerate(calls) if call.thread.is_alive()}
        self._silent = {self.member(self.clients[i]).key for i in late}
        return late

    def _tell_outcome(self, calls: list, failure: RefitFailed | None, late: set, weight_version: str | None, *,
                      complete: bool) -> None:
        """After an update (`complete`: no rank failed it): each member's weight version becomes `weight_version`
        when every group was committed, stays when none was, and otherwise says what it holds
        (`transfer.versions.label`: partial, or mixed where its workers may differ), told by rank 0 (`_tell`).
        A failure then raises one line on every trainer rank (`UpdateFailed`)."""
        states = self._states(failure, late) if failure is not None and self.is_sender else {}
        if failure is not None and failure.held:  # what every worker holds, as each recorded it (the same on
            failure.committed = failure.groups[:min(failure.held.values())]  # every rank)
        labels = {i: weight_version if failure is None else label(weight_version, h) for i, h in
                  (states.items() if failure is not None else enumerate(self.clients))}
        paused = self._tell(calls, labels, states, late, complete=complete) if self.is_sender else False
        if failure is not None:
            if failure.broken:  # the group is given up: the next refit needs a new trainer_init
                self.shutdown()
            raise UpdateFailed(self._failure_line(failure, paused), failure) from None

    def _states(self, failure: RefitFailed, late: set) -> dict:
        """Rank 0, after a failure: what each member holds (`transfer.versions.Held`) from what its workers
        recorded; a member that did not answer may have committed up to the last group whose agreement passed
        (this rank's failing group: it took part in every agreement)."""
        n, upto = len(failure.groups), len(failure.committed)
        return {i: held_by(list(ranks), failure.held, failure.torn, n, upto=upto if i in late else None)
                for i, ranks in enumerate(self._replicas.ranks())}

    def _failure_line(self, failure: RefitFailed, paused: bool) -> str:
        """The line every trainer rank raises (from what every worker recorded, the same on each): what failed,
        then what the engines hold."""
        if not failure.torn and len(set(failure.held.values())) <= 1:
            where = progress(failure.groups, len(failure.committed))
        else:
            names, n = rank_names(self.dst, self.engine_name), len(failure.groups)
            held = [f"{names(r)}: {k}" + (f" and part of {failure.groups[k].label}" if r in failure.torn and k < n
                                          else "") for r, k in sorted(failure.held.items())]
            where = (f"the workers hold different groups of {n} ({', '.join(held)}); each engine's weight version "
                     f"says what it holds; the next refit repairs it")
        note = ("; the engine is paused until a complete refit lands (on_partial: serve keeps it serving)"
                if paused else "")
        return f"reshard: {failure.line}; {where}{note}"

    def _tell(self, calls: list, labels: dict, states: dict, late: set, *, complete: bool) -> bool:
        """Rank 0: every member that answered finishes the update, labelled with what it holds (what the old
        weights left dropped if anything changed), paused after a partial one (`on_partial: pause`) or resumed
        after a complete one; the others are told when they answer. Whether any member is paused now."""
        for i, client in enumerate(self.clients):
            held = states.get(i)
            partial = held is not None and held.partial
            if i in late:
                self._tell_later(client, calls[i], labels.get(i), partial=partial)
                continue
            # after a failure, an engine that is gone refuses the finish and says nothing new
            member = self.member(client)
            finish = member.finish if complete else partial_call(_quietly, member.finish)
            finish(labels.get(i), changed=complete or (held is not None and held.hi > 0))
            self._pause_or_resume(client, partial=partial, complete=complete)
        return any(self.member(c).key in PAUSED for c in self.clients)

    def _tell_later(self, client, call: Call, version: str | None, *, partial: bool) -> None:
        """A member that did not answer when the update failed (a stopped server, a worker still busy): on a
        thread of its own, once its update call returns (within the group's timeout), it is told as the others
        were: finished, labelled, paused per `on_partial`, and its transfer engine shut down (its group is
        gone). One that never answers keeps its session open: a later `trainer_init` (or `add`) finds it open
        in the handshake and finishes it first; `add` also calls the telling off (`_call_off`). `settle()`
        waits for these."""
        member, off, lock = self.member(client), threading.Event(), threading.Lock()

        def tell():
            call.join(timeout=self.info.timeout, quiet=True)
            with lock:
                if off.is_set() or call.thread.is_alive():
                    why = "added again first" if off.is_set() else f"no answer within {self.info.timeout:.0f} s"
                    self.events.append({"event": "not told", "member": member.name, "why": why})
                    return
                _quietly(member.finish, version, changed=version is not None)
                _quietly(self._pause_or_resume, client, partial=partial, complete=False)
                _quietly(member.shutdown)
            self.events.append({"event": "told", "member": member.name, "weight_version": version,
                                "paused": member.key in PAUSED})
        thread = threading.Thread(target=tell, daemon=True, name=f"reshard-tell-{member.name}")
        self._telling[member.key] = (thread, off, lock)
        thread.start()

    def _call_off(self, client) -> None:
        """A member being added again: its pending telling (`_tell_later`) is called off, after any call it is
        making now, so it cannot finish or shut down the new member's session."""
        thread, off, lock = self._telling.pop(self.member(client).key, (None, None, None))
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
        """After an update that left an engine on a mix of two steps: pause its generation (requests kept
        queued) unless `on_partial: serve`; after a complete one: resume it if reshard paused it (a failure
        that committed nothing leaves it as it was: still a mix)."""
        member = self.member(client)
        if partial and self.info.on_partial == "pause":
            if member.key not in PAUSED and _quietly(member.pause):
                PAUSED.add(member.key)
        elif complete and member.key in PAUSED:
            _quietly(member.resume)
            PAUSED.discard(member.key)


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


def _quietly(fn, *args, **kwargs):
    """A control-plane call whose failure is expected and says nothing new (a finish where the engine already
    ended the update); its result, None after a failure."""
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001
        return None


def _versions(tensors: Mapping[str, torch.Tensor]) -> dict:
    """Each tensor's in-place version counters (a DTensor's own, which an optimizer step on it moves, and its
    local shard's, which an in-place change of the shard moves)."""
    return {n: (x._version, x._local_tensor._version) if isinstance(x, DTensor) else x._version
            for n, x in tensors.items()}
