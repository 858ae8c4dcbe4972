"""Live refit between running trainer and inference processes.

Every process of the job (trainer, inference, idle) creates one `Refit` after `init_process_group` and calls
it after each optimizer step:

    refit = Refit(role="src", dst="infer.yaml")        # a trainer process; its layout comes from its DTensors
    refit = Refit(role="dst", src="train.yaml", dst="infer.yaml")   # or both layouts from YAML
    stats = refit(named_tensors)                       # src: local shards or DTensors; dst: buffers, written in place

A layout left out is read from the DTensors the group's ranks pass on the first call (their device_mesh and
placements; every rank shares its specs once). The plan, buffers and groups are built on that first call and
reused by every later refit; each call writes into the destination buffers passed with it (usually the same
storage every time, so an engine's pointers stay valid).
"""
from __future__ import annotations

import itertools
import os
import time
import weakref
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from reshard_cli.errors import ConfigError, ReshardError, RuntimeFailure
from reshard_cli.layouts.layout import Layout, Mesh, Placement
from reshard_cli import formats
from reshard_cli.base import checksums
from reshard_cli.formats import load_layout, load_pair
from reshard_cli.layouts.models import Manifest, TensorSpec
from reshard_cli.layouts.quant import amax_names
from reshard_cli.formats.base import checked_stage_mb
from reshard_cli.plan.groups import Group, layer_groups, resume_group, stage_bytes
from reshard_cli.plan.planner import Plan
from reshard_cli.layouts.topology import NO_TOPOLOGY, Topology, load_topology
from reshard_cli.transfer import verify
from reshard_cli.transfer.agree import gather_failures, one_line
from reshard_cli.transfer.comm import STALL, WORLD, GroupComm, WorldComm, world_guard
from reshard_cli.transfer.shm import checked_transport, with_transport
from reshard_cli.codecs import Codec, codec_for
from reshard_cli.transfer.watchdog import GroupBroken
from reshard_cli.transfer.engine import Engine
from reshard_cli.transfer.pipeline import build_engine, ready_plan, transfer_options
from reshard_cli.transfer.shards import LocalShard


@dataclass
class RefitStats:
    seconds: float  # this rank's wall time of the refit
    bytes_sent: int  # by this rank, this refit
    checksums_ok: bool | None  # None when not verified
    bytes_received: int = 0  # by this rank, this refit
    groups: int = 1  # staging groups the refit ran in (`stage_mb`)
    checksum: int | None = None  # verified destination: of everything this rank received, all it holds unless
    # resumed (equal on two replicas' ranks at the same position exactly when they hold the same values)
    first_group: int = 0  # a resumed refit's first group (those before it were committed earlier)


class Stage:
    """Where a destination rank's bytes land when a refit runs in agreed groups (`stage_mb`), in the steps of a
    two-phase commit: each group's buffers are opened just before its bytes arrive; once they arrived and
    were verified, the group is prepared (everything that can fail: an engine's conversion into its own
    format, every allocation), and committed only once every rank of the refit has said that its group
    arrived intact and was prepared. The commit only swaps in what was prepared: it must not fail. On any
    rank's failure before it, the group is aborted everywhere. An engine implements it to convert a group
    into its own format and release the staging before the next group arrives."""

    def open(self, group: Group, layout: Layout) -> Mapping[str, torch.Tensor]:
        """Buffers for the group's tensors (`layout` holds only them), keyed by checkpoint name; the weights a
        quantized engine stores in its own form as its codec's landings (`codecs`: its storage, where the refit
        writes what travels encoded)."""
        raise NotImplementedError

    def local_max(self, group: Group, names: list[str]) -> Mapping[str, float]:
        """Before `prepare`, where the destination layout asks for it (`layouts.quant.amax_names`: an engine
        whose processing needs a value reduced over all shards of a tensor, a per-tensor scale's max |x|):
        this rank's value of each of `names` (absent: none here). The refit takes the maximum over every rank
        of its group, under its watchdog, and hands it to `reduced`, so the engine needs no collective of its
        own while a peer may already have failed. May fail (agreed like `prepare`)."""
        return {}

    def reduced(self, group: Group, maxima: Mapping[str, float]) -> None:
        """The maxima of `local_max` over every rank of the refit (0 where no rank had a value), before
        `prepare`."""

    def prepare(self, group: Group) -> None:
        """The group arrived intact here: make it ready to swap in, without touching what the engine computes
        with (may fail: the failure is agreed like a transfer's)."""

    def commit(self, group: Group) -> None:
        """Every rank has the group, verified and prepared: make it what the engine computes with (must not
        fail)."""

    def abort(self, group: Group) -> None:
        """Some rank failed on this group: what the engine computes with stays as it was."""


class RefitFailed(RuntimeFailure):
    """A refit in agreed groups failed on some rank; every rank raises the same line. `committed`: the groups
    committed before the failure (the same on every rank), `groups`: all of them."""

    def __init__(self, message: str, committed: list[Group], groups: list[Group], exit_code: int = 1,
                 broken: bool = False, ranks: tuple = (), line: str | None = None):
        super().__init__(message)
        self.committed, self.groups, self.exit_code = committed, groups, exit_code
        self.broken = broken  # the refit group is given up (a rank died, stalled or failed mid-transfer)
        self.ranks = ranks  # with `broken`: the refit ranks the line names
        self.line = line or message  # what failed, without what it left the destinations holding
        self.held: dict[int, int] = {}  # destination rank -> groups it committed in this refit, as it recorded
        # them on the group's store (`Refit.held`), where a rank could record
        self.torn: set[int] = set()  # destination ranks whose commit of the next group failed part-way (a
        # defect): they hold part of that group too (`Refit.torn`)

    @property
    def partial(self) -> bool:
        return bool(self.committed)


@dataclass
class _Part:
    """One staging group's plan, and its engine once bound to tensors."""

    group: Group
    plan: Plan
    engine: Engine | None = None
    bound: tuple | None = None  # what the engine's shards are views of (see `Refit._bind`)
    casts: list = field(default_factory=list)  # (converted copy, parameter) made at binding
    checksum: int | None = None  # the last verification's, of this rank's destination shards


class Refit:
    def __init__(self, role: str, *, src: str | Path | Layout | None = None, dst: str | Path | Layout | None = None,
                 topology: str | Path | Topology | None = None, mode: str = "auto", bucket_mb: float = 64,
                 reshard_match: str | None = None, device: torch.device | str | None = None,
                 group: GroupComm | None = None, stage_mb: float | None = None, who: str = "",
                 stall: float = STALL, transport: str = "auto"):
        """`group`: a refit group of its own (`transfer.comm.refit_group`) instead of the default process group,
        for processes whose default group belongs to someone else (an inference engine's workers). Ranks in
        the layouts, and a DTensor mesh's ranks, are then the group's ranks; every mode and topology runs over
        it (the broadcast route's sub-groups are made on the group's own store).

        `stage_mb`: run every refit in agreed groups of whole layers (`plan.groups`), each at most this many MiB
        of checkpoint-format tensors on any destination rank (0: one group). Each group is bound, moved and
        verified, and committed (a destination's `Stage`) only after every rank of the refit agreed that it
        arrived intact; any rank's failure aborts that group everywhere and raises `RefitFailed` on every rank.
        Every rank must pass the same value. None (the default): one group, no agreement rounds. `who`: what
        this rank is, in such errors ("trainer 1", "vLLM worker 0").

        `stall`: over the default group, the seconds a rank may go without a heartbeat before every other rank
        names it and the refit ends (the watchdog this Refit keeps over a job nobody else guards; every wait
        of the refit is bounded by it). A refit group keeps the limit it was made with (`refit_group(stall=)`).
        Every rank should pass the same value.

        `transport`: what carries the messages: "auto" (the group's backend) or "shm" (between ranks on one host
        through shared memory, `transfer.shm`; the group's backend between hosts). Every rank passes the same."""
        if role not in ("src", "dst", "idle"):
            raise ConfigError(f"role must be 'src', 'dst' or 'idle', not {role!r}", key="role")
        if group is None and not dist.is_initialized():
            raise ConfigError("call torch.distributed.init_process_group before creating a Refit, or pass group=",
                              key="Refit")
        self.comm = group if group is not None else WORLD
        # a Refit over the default group of a job whose launcher set no watchdog on it (a user's own torchrun
        # job) keeps one of its own from set-up on, under keys numbered by the Refits created in this process
        self._world_refit = next(_WORLD_REFITS) if group is None else None
        self._guard = None
        self.transport, self._carrier = transport, None  # checked with the other settings, below
        self.role, self.who = role, who
        self.rank = self.comm.rank
        self.calls = 0  # refits run (the key of what a destination records as committed)
        try:
            self._configure(src, dst, topology, mode, bucket_mb, reshard_match, device, stage_mb, stall)
        except ReshardError as e:  # the peers' first collective is set-up's: they learn it there and name this
            try:  # rank, instead of pairing with whatever this program does next
                self.comm.all_gather_object({"failed": str(e), "code": e.exit_code}, what=_SETUP)
            except ReshardError:
                pass  # the group broke meanwhile: this rank's own error says more
            raise

    def _configure(self, src, dst, topology, mode, bucket_mb, reshard_match, device, stage_mb, stall) -> None:
        stage_mb = checked_stage_mb(stage_mb)
        checked_transport(self.transport, key="transport")
        if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not 0 < stall < float("inf"):
            raise ConfigError(f"stall must be a positive number of seconds, not {stall!r}", key="stall")
        self.stall = float(stall)
        self._closed = False  # close() was called: every later call raises
        if isinstance(src, (str, Path)) and isinstance(dst, (str, Path)):
            self._src, self._dst = load_pair(src, dst)  # dst ranks default to right after src
        else:
            self._src, self._dst = _as_layout(src), _as_layout(dst)
        self.topology = load_topology(topology) if isinstance(topology, (str, Path)) else (topology or NO_TOPOLOGY)
        self.mode, self.reshard_match = mode, reshard_match
        self.options = transfer_options(bucket_mb)
        self.stage_bytes = None if stage_mb is None else stage_bytes(stage_mb)
        self.device = torch.device(device) if device is not None else None
        self.plan: Plan | None = None  # the whole refit's plan
        self.parts: list[_Part] = []  # one per staging group (one: the whole plan)

    @property
    def engine(self) -> Engine | None:
        """The whole refit's engine (a refit in one group)."""
        return self.parts[0].engine if len(self.parts) == 1 else None

    @property
    def groups(self) -> list[Group]:
        return [p.group for p in self.parts]

    def __call__(self, tensors: Mapping[str, torch.Tensor] | None = None, *, verify_checksums: bool = False,
                 stage: Stage | None = None, resume_layer: int | None = None) -> RefitStats:
        """One refit. `tensors`: this rank's sources, or its destination buffers (written in place); a
        destination that refits in groups may pass a `stage` instead, which opens each group's buffers.
        `resume_layer`: every destination already holds this refit's tensors outside the decoder layers and
        its layers below this one (a fleet's survivors after a member was dropped: what they committed): the
        refit starts at the first staging group holding a later layer (the last group if none does), and the
        groups before it are not sent again. In layers, not groups: a fleet of another size may group the
        layers otherwise. Every rank passes the same."""
        tensors = tensors or {}
        if self.plan is None:
            try:
                self._setup(tensors)
            except GroupBroken as e:
                raise RefitFailed(f"{e}; {self._progress(0)}", [], [], broken=True, ranks=e.ranks,
                                  line=str(e)) from None
        first_group = resume_group(self.groups, resume_layer)  # 0 for a refit in one group: it runs whole
        # No barriers: the messages themselves order the ranks. When this returns, this rank's part is done
        # (a destination's buffers hold the new weights; a source may change its tensors again).
        t0 = time.perf_counter()
        sent = received = 0
        good = True
        self.calls += 1
        self._record_held(first_group)  # what a resumed refit's destinations committed before it
        for i, part in enumerate(self.parts):
            if i < first_group:
                continue
            if self.stage_bytes is None:
                self._bind(part, tensors, agreed=part.engine is None)
                self._told("the transfer", self._move, part)
                if verify_checksums:
                    good &= self._told("the verification", self._verify, part)
            else:
                good &= self._agreed_group(i, part, tensors, verify_checksums, stage)
            sent, received = sent + part.engine.bytes_sent, received + part.engine.bytes_received
            if len(self.parts) > 1:
                self._told("releasing the staging", part.engine.release_staging)  # one group's staging at a time
        held = verify_checksums and self.rank in self.plan.dst.ranks
        return RefitStats(time.perf_counter() - t0, sent, good if verify_checksums else None, received,
                          groups=len(self.parts), first_group=first_group,
                          checksum=checksums.combine(p.checksum for p in self.parts[first_group:]) if held else None)

    # ------------------------------------------------------------------------------------------ set-up

    def _told(self, what: str, fn, *args):
        """`fn(*args)`, whose failure (any exception) is told to every rank of the group first: a peer waiting
        on this rank's bytes names it within a second instead of at its stall limit. `what`: the step, for
        the line."""
        try:
            return fn(*args)
        except GroupBroken:
            raise
        except Exception as e:  # noqa: BLE001
            self.comm.fail(f"{self._me()}: {what} failed ({type(e).__name__}: {e})", (self.rank,))

    def _record_held(self, committed: int, *, torn: bool = False) -> None:
        """A destination rank records on the group's store how many groups of this refit it has committed (and
        `torn`: that its commit of the next one failed part-way), so the trainer's report says what every rank
        actually holds, even after the group broke."""
        if self.rank in (self.plan.dst.ranks if self.plan is not None else ()):
            self.comm.note(f"held/{self.rank}", f"{self.calls}:{committed}" + (":torn" if torn else ""))

    def held(self) -> dict[int, int]:
        """Every destination rank's groups committed in this refit, as recorded (a rank that recorded nothing
        for it, dead before its first group, holds none of it); {} without a store to read."""
        return {r: n for r, (n, _torn) in self._records().items()}

    def torn(self) -> set[int]:
        """The destination ranks whose commit failed part-way in this refit (they hold part of one more group
        than `held` says)."""
        return {r for r, (_n, torn) in self._records().items() if torn}

    def _records(self) -> dict[int, tuple[int, bool]]:
        if self.plan is None:
            return {}
        got = self.comm.read([f"held/{r}" for r in self.plan.dst.ranks])
        if got is None:
            return {}
        out = {}
        for r, raw in zip(self.plan.dst.ranks, got):
            call, n, torn = ((raw or "").split(":") + ["", ""])[:3]
            out[r] = (int(n), torn == "torn") if call == str(self.calls) else (0, False)
        return out

    def close(self) -> None:
        """End this Refit: stop the watchdog it keeps over the default group, if it keeps one (also done when
        it is collected, and at exit), and let its plan and engines go. A later call raises one line instead
        of waiting on heartbeats that have stopped: make a new Refit to refit again."""
        self._closed = True
        self.plan, self.parts = None, []  # a later call goes through set-up, which refuses it
        if self._carrier is not None and self._carrier[1] is not self._carrier[0]:
            self._carrier[1].close()  # a shared-memory transport's files
        self._carrier = None
        if self._guard is not None:
            self._guard_closer()
            self._guard = None

    def _watch_world(self):
        """The watchdog of a Refit over a default group nobody guards, made before set-up's collective (which
        every rank passes only once every heartbeat key exists); None when the job's store cannot be reached
        from the environment (the group was not set up from MASTER_ADDR/MASTER_PORT)."""
        if self._world_refit is None or WORLD.guard is not None:
            return None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives a restart
        return world_guard(self.device or WORLD.device, stall=self.stall, label="refit rank",
                           prefix=f"reshard-refit/{restart}/{self._world_refit}/")

    def _setup(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if self._closed:
            raise ConfigError(f"{self._me()}: this Refit was closed (Refit.close): make a new Refit to refit again")
        specs = {name: _spec_of(name, x) for name, x in tensors.items()}
        try:
            guard = self._watch_world()
        except Exception:  # noqa: BLE001 - the job's store cannot be reached from here: no watchdog, agreed below
            guard = None
        try:
            gathered = self.comm.all_gather_object((self.role, specs, guard is not None, self.who or self.role),
                                                   what=_SETUP)
            watched = all(isinstance(g, tuple) and g[2] for g in gathered)
            roles = [g[3] if isinstance(g, tuple) and len(g) > 3 else "" for g in gathered]
            gathered = [g[:2] if isinstance(g, tuple) else g for g in gathered]
            if guard is not None and not watched:  # a watchdog only if every rank has one (a rank without
                guard.close()  # would never beat, and be named)
                guard = None
            if guard is not None:  # every rank's heartbeat key exists now: the waits from here on are guarded
                guard.watchdog.start()
                self.comm, self._guard = WorldComm(), guard
                self.comm.guard = guard
                self.comm.name_ranks(roles)  # its lines say what each rank is: "refit rank 2 (dst)"
                self._guard_closer = weakref.finalize(self, guard.close)
            self._plan_from(gathered)
        except BaseException:
            if guard is not None:  # set-up failed on every rank alike: nothing of this refit runs (a later
                (self._guard_closer if self._guard is not None else guard.close)()  # call sets up again)
                self.comm, self._guard = WORLD, None
            raise

    def _plan_from(self, gathered: list) -> None:
        failed = [(r, g) for r, g in enumerate(gathered) if isinstance(g, dict) and "failed" in g]
        if failed:
            r, g = failed[0]
            raise ConfigError(f"refit rank {r}: its set-up failed: {g['failed']}") if g["code"] == 2 else \
                RuntimeFailure(f"refit rank {r}: its set-up failed: {g['failed']}")
        layouts = {}
        for role, given in (("src", self._src), ("dst", self._dst)):
            if given is not None:
                layouts[role] = given
                continue
            merged: dict[str, dict] = {}
            for r, (rr, sp) in enumerate(gathered):
                if rr == role:
                    for name, s in sp.items():
                        if s is None:
                            raise ConfigError(f"rank {r} passed a plain tensor for {name!r}, but no {role} layout "
                                              f"was given: pass DTensors or a layout", key=role)
                        merged.setdefault(name, s)
            if not merged:
                raise ConfigError(f"no {role} layout given and no rank passed DTensors as {role}", key=role)
            other = layouts.get("src") or self._dst  # list the tensors in a given layout's order
            layouts[role] = _layout_from_specs(role, merged, other.manifest if other else None)
        src, dst = layouts["src"], layouts["dst"]
        diff = src.manifest.diff(dst.manifest)
        if diff:
            raise ConfigError(f"src and dst models differ: {'; '.join(diff)}", key="dst")
        dst = dst.in_order_of(src.manifest)  # the plan pairs tensors by position
        overlap = set(src.ranks) & set(dst.ranks)
        if overlap:
            raise ConfigError(f"src and dst ranks overlap (rank {min(overlap)})", key="ranks")
        plan = partial(ready_plan, topology=self.topology, mode=self.mode, reshard_match=self.reshard_match,
                       bucket_bytes=self.options.bucket_bytes)
        self.plan = plan(src, dst)
        groups = layer_groups(dst, self.stage_bytes)
        if len(groups) == 1:
            self.parts = [_Part(groups[0], self.plan)]
        else:
            self.parts = [_Part(g, plan(src.subset(g.tensors), dst.subset(g.tensors))) for g in groups]

    def _bind(self, part: _Part, tensors: Mapping[str, torch.Tensor], *, agreed: bool) -> None:
        """Bind the part's engine to the tensors passed on this call (a first call builds the engine; `agreed`:
        every rank learns of any rank's binding error first, as a collective)."""
        error, shards = None, None
        try:
            shards = self._shards_of(part, tensors)
        except ConfigError as e:
            if not agreed:
                raise
            error = str(e)
        if agreed:
            failed = gather_failures(partial(self.comm.all_gather_object, what="binding"), error, exit_code=2)
            if failed:
                raise ConfigError(one_line(failed, me=self.rank, label="refit rank"))
        self._told("setting up the transfer", self._install, part, shards, tensors)

    def _shards_of(self, part: _Part, tensors: Mapping[str, torch.Tensor]) -> tuple | None:
        """This call's shards for the part, None when they are unchanged. Destination buffers may be new
        storage on every call (an engine that re-materializes its weights for each update); they are checked
        like the first ones. When every tensor is the same storage, shape and strides as last time (a trainer
        updating its parameters in place), the binding and the engine's views are kept; only converted copies
        are refreshed with the current values."""
        if part.engine is not None and _storage_of(tensors) == part.bound:
            for copy, param in part.casts:
                copy.copy_(param)
            return None
        part.casts = []
        return self._shards(part, tensors)

    def _install(self, part: _Part, shards: tuple | None, tensors: Mapping[str, torch.Tensor]) -> None:
        """The part's engine on `shards` (collective when it is built: every rank, same order)."""
        if shards is None:
            return
        src_shards, dst_shards = shards
        if part.engine is None:
            device = self.device or next((s.data.device for s in (*src_shards.values(), *dst_shards.values())),
                                         torch.device("cpu"))
            part.engine = build_engine(part.plan, self.rank, src_shards, dst_shards, self.options, device,
                                       comm=self._carried(device))
        else:
            part.engine.src_shards, part.engine.dst_shards = src_shards, dst_shards
        part.bound = _storage_of(tensors)

    def _carried(self, device: torch.device):
        """The comm the engines' messages go over: the group's, or shared memory wrapping it (made once per
        group the Refit runs over; collective, as building an engine is)."""
        if self.transport == "auto":
            return self.comm
        if self._carrier is None or self._carrier[0] is not self.comm:
            if self._carrier is not None:
                self._carrier[1].close()
            self._carrier = (self.comm, with_transport(self.comm, self.transport, device))
        return self._carrier[1]

    def _shards(self, part: _Part, tensors: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        """Check what this rank passed against the part's plan and wrap it (views, no copies)."""
        src_shards: dict[int, LocalShard] = {}
        dst_shards: dict[int, LocalShard] = {}
        for role, layout, out in (("src", part.plan.src, src_shards), ("dst", part.plan.dst, dst_shards)):
            if self.rank not in layout.ranks:
                continue
            man = layout.manifest
            held_names = (man.tensors[t].name for t, _ in layout.held(self.rank))
            bind = formats.get(layout.format).bind
            if bind is not None and any(n not in tensors for n in held_names):  # the framework's own names
                tensors = {**tensors, **bind(tensors, layout, self.rank, part.casts)}
            for t, box in layout.held(self.rank):
                spec = man.tensors[t]
                if spec.name not in tensors:
                    raise ConfigError(f"rank {self.rank} holds {spec.name!r} in the {role} layout but did not pass it",
                                      key=spec.name)
                given = tensors[spec.name]
                codec = codec_for(part.plan)
                if role == "dst" and codec.stores(t):
                    out[t] = LocalShard(box, *codec.shard(self.rank, t, box, given))
                    continue
                local = _local(given)
                if tuple(local.shape) != box.sizes or str(local.dtype).removeprefix("torch.") != spec.dtype:
                    raise ConfigError(f"rank {self.rank}: {spec.name} is {list(local.shape)} {local.dtype}, the "
                                      f"{role} layout expects {list(box.sizes)} {spec.dtype}", key=spec.name)
                if role == "dst" and not local.is_contiguous():
                    raise ConfigError(f"rank {self.rank}: destination buffer {spec.name} must be contiguous",
                                      key=spec.name)
                out[t] = LocalShard(box, local)
        return src_shards, dst_shards

    # ---------------------------------------------------------------------------------------- moving

    def _move(self, part: _Part) -> None:
        eng = part.engine
        eng.bytes_sent = eng.bytes_received = 0  # this refit's, not a running total
        eng.run_reshard()
        eng.run_broadcast()
        eng.finish_received()  # a quantized engine: the blocks that arrived in the source's dtype
        self.comm.synchronize(eng.device, what="the transfer")  # CUDA: polled under the watchdog

    def _verify(self, part: _Part) -> bool:
        """Checksums: each destination shard against the sources' checksum of the same box (collective)."""
        return not self._mismatched(part, everywhere=True)

    def _mismatched(self, part: _Part, *, everywhere: bool = False) -> list[int]:
        """Collective: the destination tensors on this rank (`everywhere`: on any rank, as [-1]) whose
        checksum differs from the sources' checksum of the same box."""
        eng = part.engine
        actual, mismatched, _ = verify.mismatched_checksums(part.plan, self.rank, eng.src_shards, eng.dst_shards,
                                                            comm=self.comm)
        part.checksum = checksums.combine(actual[t] for t in sorted(actual))
        if not everywhere:
            return mismatched
        flag = torch.tensor([1 if mismatched else 0])
        self.comm.all_reduce_max(flag)
        return [-1] if int(flag.item()) else []

    def _agreed_group(self, i: int, part: _Part, tensors, verify_checksums: bool, stage: Stage | None) -> bool:
        """One group under agreement: open and bind (agreed), move and verify (agreed), then commit, or abort
        everywhere. Returns whether the checksums matched (True when not verified). A refit group whose
        watchdog names a failed, dead or stalled rank ends the group at once on every rank that sees it."""
        opened = stage if stage is not None and self.rank in part.plan.dst.ranks else None
        try:
            return self._group_steps(i, part, tensors, verify_checksums, opened)
        except GroupBroken as e:
            if opened is not None:
                opened.abort(part.group)
            raise RefitFailed(f"{e}; {self._progress(i)}", self.groups[:i], self.groups, broken=True,
                              ranks=e.ranks, line=str(e)) from None
        finally:
            if opened is not None and part.engine is not None:  # the group's buffers are the engine's again:
                part.engine.unbind_destination()  # holding on to them would keep every group's staging alive
                part.bound = None

    def _group_steps(self, i: int, part: _Part, tensors, verify_checksums: bool, opened: Stage | None) -> bool:
        error, shards, code = None, None, 1
        try:
            if opened is not None:
                tensors = opened.open(part.group, part.plan.dst)
            shards = self._shards_of(part, tensors)
        except Exception as e:  # noqa: BLE001 - a wrong buffer, or an engine's own failure (out of memory)
            error = str(e) if isinstance(e, ReshardError) else f"{type(e).__name__}: {e}"
            code = 2 if isinstance(e, ConfigError) else 1
        self._agree(i, part, error, opened, code=code, step="opened")
        self._told("setting up the transfer", self._install, part, shards, tensors)
        error, bad = None, []
        self._told("the transfer", self._move, part)  # peers may wait on its bytes: a failure breaks the group
        if verify_checksums:
            bad = self._told("the verification", self._mismatched, part)
            if bad:
                error = (f"checksums differ after the transfer in {len(bad)} tensor(s), first "
                         f"{part.plan.dst.manifest.tensors[bad[0]].name}")
        names = amax_names(part.plan.dst)  # the same on every rank: a guarded reduction the engine needs
        error, failed = self._reduce_max(part, names, opened, error) if names else (error, False)
        if opened is not None and error is None and not failed:
            try:  # phase one: everything that can fail, before the last agreement
                opened.prepare(part.group)
            except Exception as e:  # noqa: BLE001 - the engine's processing (out of memory, a kernel's repacking)
                error = f"preparing {part.group.label} failed ({type(e).__name__}: {e})"
        self._agree(i, part, error, opened, code=1, step="prepared")
        if opened is not None:  # phase two: every rank has the group, prepared; swapping it in cannot fail
            try:
                opened.commit(part.group)
            except Exception as e:  # noqa: BLE001 - a defect: told to everyone, the store says what this rank holds
                self._record_held(i, torn=True)
                self.comm.fail(f"{self._me()}: committing {part.group.label} failed after every rank agreed "
                               f"({type(e).__name__}: {e}); it holds {i} group(s) of this refit and part of "
                               f"{part.group.label}", (self.rank,))
            self._record_held(i + 1)
        return not bad

    def _reduce_max(self, part: _Part, names: list[str], stage: Stage | None, error: str | None) -> tuple:
        """Collective, under the group's watchdog: the maximum over every rank of each name's value
        (`Stage.local_max`; a source contributes 0), handed to the stage (`Stage.reduced`). A rank that failed
        before it still takes part, with a flag: every rank then skips `prepare` and the agreement after names
        it. Returns (this rank's error, whether any rank had failed)."""
        values = torch.zeros(len(names) + 1, dtype=torch.float32)
        if stage is not None and error is None:
            try:
                local = stage.local_max(part.group, names)
                values[1:] = torch.tensor([float(local.get(n, 0.0)) for n in names], dtype=torch.float32)
            except Exception as e:  # noqa: BLE001 - the engine's own step
                error = f"reducing {part.group.label} failed ({type(e).__name__}: {e})"
        values[0] = 0.0 if error is None else 1.0
        self._told("the reduction", self.comm.all_reduce_max, values)
        failed = bool(values[0].item())
        if stage is not None and error is None and not failed:
            try:
                stage.reduced(part.group, dict(zip(names, values[1:].tolist())))
            except Exception as e:  # noqa: BLE001
                error = f"reducing {part.group.label} failed ({type(e).__name__}: {e})"
        return error, failed

    def _agree(self, i: int, part: _Part, error: str | None, stage: Stage | None, *, code: int, step: str) -> None:
        """Collective: every rank's error for group i at `step`; on any, the group is aborted here and every
        rank raises the same line."""
        failed = gather_failures(partial(self.comm.all_gather_object, what=f"group {i} {step}"), error,
                                 exit_code=code, role=self.who)
        if not failed:
            return
        if stage is not None:
            stage.abort(part.group)
        line = one_line(failed, label="refit rank")
        raise RefitFailed(f"{line}; {self._progress(i)}", self.groups[:i], self.groups,
                          exit_code=max(f.exit_code for f in failed) if i == 0 else 1, line=line)

    def _progress(self, i: int) -> str:
        return progress(self.groups, i)

    def _me(self) -> str:
        return f"refit rank {self.rank}" + (f" ({self.who})" if self.who else "")


_SETUP = "refit set-up"
_WORLD_REFITS = itertools.count()  # Refits over the default group made in this process (the same order on every rank)


def progress(groups: list[Group], i: int) -> str:
    """What the destination computes with after a refit in these groups failed with the first i committed."""
    if i == 0:
        return "nothing was committed: every destination keeps its previous weights"
    return (f"committed {i} of {len(groups)} groups ({_labels(groups[:i])}: new weights; {_labels(groups[i:])}: "
            f"previous weights); the next refit repairs it")


def _labels(groups: list[Group]) -> str:
    """Groups' layers in few words ("layers 0-5", "embeddings/norm/head + layers 0-2, layers 3-5")."""
    layers = sorted(n for g in groups for n in g.layers)
    outside = any(g.outside for g in groups)
    spans: list[str] = []
    for n in layers:
        if spans and spans[-1][1] == n - 1:
            spans[-1] = (spans[-1][0], n)
        else:
            spans.append((n, n))
    words = ["embeddings/norm/head"] if outside else []
    words += [f"layer {a}" if a == b else f"layers {a}-{b}" for a, b in spans]
    return ", ".join(words)


# ---------------------------------------------------------------------------------------------- helpers


def _as_layout(x) -> Layout | None:
    if x is None or isinstance(x, Layout):
        return x
    return load_layout(x)


def _storage_of(tensors: Mapping[str, torch.Tensor]) -> tuple:
    """Where every passed tensor's data lives: equal between two calls exactly when the same names are views
    of the same memory with the same shapes, strides and dtypes."""
    out = []
    for name, x in tensors.items():
        for y in Codec.buffers(x) if hasattr(x, "buffers") else (_local(x),):
            out.append((name, y.data_ptr(), tuple(y.shape), y.stride(), y.dtype, y.device))
    return tuple(out)


def _local(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    x = x.to_local() if isinstance(x, DTensor) else x
    return x.detach()  # same storage; refit never records autograd history


def _spec_of(name: str, x: torch.Tensor) -> dict | None:
    """What a DTensor says about its layout (None for a plain tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(x, DTensor):
        return None
    shard = []
    for p in x.placements:
        if isinstance(p, Shard) and type(p) is Shard:
            shard.append(p.dim)
        elif isinstance(p, Replicate):
            shard.append(None)
        else:  # Partial sums and _StridedShard index lists are not boxes
            raise ConfigError(f"{name}: placement {p} is not supported (Shard(d) and Replicate are)", key=name)
    mesh = x.device_mesh
    return {"shape": tuple(x.shape), "dtype": str(x.dtype).removeprefix("torch."),
            "mesh_shape": tuple(mesh.mesh.shape), "mesh_ranks": tuple(mesh.mesh.flatten().tolist()),
            "dims": tuple(mesh.mesh_dim_names or (f"d{i}" for i in range(mesh.ndim))), "shard": tuple(shard)}


def _layout_from_specs(role: str, specs: dict[str, dict], order: Manifest | None) -> Layout:
    names = [t.name for t in order.tensors if t.name in specs] if order else sorted(specs)
    names += sorted(set(specs) - set(names))
    manifest = Manifest(name=f"live-{role}", tensors=tuple(
        TensorSpec(n, tuple(specs[n]["shape"]), specs[n]["dtype"]) for n in names), source="live", config={})
    meshes: dict[tuple, Mesh] = {}
    placements = []
    for n in names:
        s = specs[n]
        key = (s["dims"], s["mesh_shape"], s["mesh_ranks"])
        if key not in meshes:
            meshes[key] = Mesh(f"mesh{len(meshes)}", s["dims"], s["mesh_shape"], s["mesh_ranks"])
        placements.append(Placement(meshes[key], s["shard"], (None,) * len(s["dims"])))
    interned: dict = {}
    placements = [interned.setdefault((p.mesh.name, p.shard), p) for p in placements]
    ranks = tuple(sorted({r for m in meshes.values() for r in m.ranks}))
    return Layout(file=f"<live {role}>", name=f"live-{role}", manifest=manifest, ranks=ranks,
                  meshes={m.name: m for m in meshes.values()}, pipeline=None, stage_of_layer=(), experts=(),
                  rules=(), placements=tuple(placements))
