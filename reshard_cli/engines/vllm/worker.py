"""The `reshard` worker engine: what vLLM's `WeightTransferEngineFactory` builds in each worker. Importing it
needs vLLM (its base class).

Per update:
  init        find this worker's place in the layout (its replica: the init's first replica + its
              data-parallel index; then its rank in the replica), check the layout against vLLM's parallel
              config and its model (every parameter covered, every view the right shape), join the refit
              group, and agree with every trainer rank on the model (names, shapes, dtypes) and the topology —
              any mismatch fails the init call on all sides with one line, before a byte moves (a worker that
              has no place, or runs another TP or PP, tells the group's store instead of joining).
  start       nothing is touched yet.
  update      the refit runs in groups of whole layers (`stage_mb` of checkpoint-format bytes at most, on any
              worker): a group's modules are staged as vLLM's layerwise reload does it (`target.EngineTarget`),
              the refit writes every received piece straight into them (no full tensor, no `load_weights`),
              every shard's checksum is compared with the sources', and only once every trainer rank and every
              worker agreed that the group arrived intact does vLLM's own post-processing turn it into the
              kernels' format (the commit); then the next group. Any failure aborts the open group everywhere:
              its modules keep their previous weights, norms included, and every side raises one line saying
              which groups were committed.
  finish      nothing left to do (a group never stays open past its update).

Calls and replies stay paired. vLLM 0.32's `collective_rpc` raises on the first failed reply it reads and
leaves the later replies queued, to be read as the next call's; and vLLM's worker itself refuses a start while
its update session is open, a finish or a shutdown while it is not. So:
  - an update never raises to vLLM: its failure (the same line on every rank that saw it) travels to the
    trainer in the update's numbers and through the refit group, and every worker's session stays open until
    the trainer's finish closes all of them alike;
  - a call this engine refuses (an update before an init) is refused by one worker only, the executor's last,
    whose reply vLLM reads last; the others return;
  - each worker knows whether vLLM's session is open on it (`update_open`) and says so in the handshake, so a
    trainer that finds one left open (its predecessor died mid-update) finishes it before it starts its own.
`path: full` runs the baseline instead (`full`).
"""
from __future__ import annotations

import logging
import time

import torch.distributed as dist

from reshard_cli.engines.fleet.handshake import (NUMBERS, digest, domain_key, handshake, layouts, rank_names,
                                                 refit_topology)
from reshard_cli.engines.vllm import compat, cpu_repairs, full
from reshard_cli.engines.vllm.plugin import ENGINE
from reshard_cli.engines.vllm.info import ReshardInitInfo, ReshardUpdateInfo
from reshard_cli.engines.vllm.target import EngineTarget
from reshard_cli.plan.groups import stage_budget_mb
from reshard_cli.errors import ConfigError, ReshardError
from reshard_cli.formats.derived import ALL2ALL_DEFAULT
from reshard_cli.formats.vllm import ALL2ALL
from reshard_cli.layouts.models import not_refit
from reshard_cli.plan.fleet import fleet_of
from reshard_cli.transfer.comm import abort_group, refit_group
from reshard_cli.transfer.live import Refit, RefitFailed
from reshard_cli.transfer.watchdog import GroupBroken

_log = logging.getLogger("reshard")


class ReshardWorkerEngine(compat.transfer_api().WeightTransferEngine):
    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        self.shutdown()
        local, dp = compat.worker_place(self.parallel_config, dist.get_rank() if dist.is_initialized() else 0)
        self.replica = init_info.replica + dp  # this worker's replica in the layout's fleet
        self.worker = self.replica * compat.workers_per_replica(self.parallel_config) + local  # its layout index
        self.local = local
        self.role = f"vLLM worker {self.worker}"
        self.reporter = _reports_failures(self.parallel_config, local)
        self.update_open = getattr(self, "update_open", False)  # vLLM's update session on this worker
        try:
            self._init(init_info)
        except ValueError:
            self.shutdown()
            if self.reporter:  # the others return: vLLM reads their replies, then this failure (see above)
                raise

    def _init(self, init_info: ReshardInitInfo) -> None:
        if init_info.path not in ("reshard", "full"):
            raise ValueError(f"reshard: path must be 'reshard' or 'full', not {init_info.path!r}")
        src, dst, error, misplaced = self._check(init_info)
        if misplaced:  # not the layout's worker (another TP, a replica too many): the group may never fill, so
            # this worker ends everyone's wait for it at once, naming itself, instead of joining
            me = self.role if self.refit_rank is None else f"refit rank {self.refit_rank} ({self.role})"
            abort_group(init_info.host, init_info.port, f"{me}: {error}", rank=self.refit_rank,
                        timeout=min(init_info.timeout, 60.0))
            raise ValueError(f"reshard: {me}: {error}")
        try:
            group = refit_group(init_info.host, init_info.port, self.refit_rank, init_info.world_size,
                                timeout=init_info.timeout, device=self.device,
                                names=rank_names(dst, ENGINE), stall=init_info.stall or None)
        except ReshardError as e:
            raise ValueError(f"reshard: {self.role}: {e}") from None
        try:
            agreed = handshake(group, self.role, digest(dst), error, domain_key(init_info.topology, self.device),
                               open_update=self.update_open, settings={"transport": init_info.transport})
            topology = refit_topology(init_info.topology, agreed.domains)
        except ReshardError as e:
            group.close()
            raise ValueError(f"reshard: {e}") from None
        self.group, self.src, self.dst, self.path = group, src, dst, init_info.path
        self.refit = None
        if self.path == "reshard":
            self.refit = Refit(role="dst", src=src, dst=dst, mode=init_info.mode, topology=topology,
                               bucket_mb=init_info.bucket_mb, group=group, device=self.device,
                               stage_mb=stage_budget_mb(dst, init_info.stage_mb), who=self.role,
                               transport=init_info.transport)
        self.last_stats = None
        self.updated = False

    def _check(self, init_info: ReshardInitInfo):
        """This worker's own checks before the handshake: (src, dst, its error or None, whether the error is
        the deployment's: another TP or PP, a place the layout does not have); sets `refit_rank` (None without
        a place), `role` and (path reshard) `target`. Without a layout there is nobody to tell: ValueError."""
        error, src, dst, misplaced = None, None, None, False
        self.refit_rank = None
        try:
            compat.check_version()
            src, dst = layouts(init_info.src, init_info.dst, init_info.trainer_size)
            self.role = worker_role(dst, self.replica, self.local, self.worker)
            self.refit_rank = dst.ranks[self.worker] if self.worker < dst.size else None
            misplaced = True
            check_deployment(dst, self.parallel_config, self.worker, self.replica)
            misplaced = False
            stage_budget_mb(dst, init_info.stage_mb)
            if init_info.path == "reshard":
                self.target = EngineTarget(self.model, dst, self.refit_rank, self.model_config)
        except ReshardError as e:
            if dst is None:
                raise ValueError(f"reshard: {self.role}: {e}") from None  # no layout: nobody to tell
            error = str(e)
        return src, dst, error, misplaced

    def start_weight_update(self) -> None:
        self.update_open = True  # vLLM opens its session on this worker when this returns
        if not self._ready():
            return
        if self.path == "full":
            cpu_repairs.unpatch(getattr(self, "patched", []))  # (a start without a finish)
            self.patched = cpu_repairs.pack_on_reload(self.model)  # before the reload puts the experts on meta
            self.tied_owners = cpu_repairs.tied_later_owners(self.model)  # (and the tied parameters)
            compat.begin_reload(self.model)
        elif self.target is not None:
            self.target.abort()  # a group some earlier failure left open, if any
        self.updated = False

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        if not self._ready():
            return
        if self.updated:
            self._refuse("one update_weights per start_weight_update (it moves every tensor)")
            return
        t0 = time.perf_counter()
        stats = {"worker": self.refit_rank, "replica": self.replica, "error": None}
        broken = False
        try:
            stats.update(self._receive(update_info))
        except RefitFailed as e:  # the same line on every rank that saw it
            stats.update(error=str(e), committed_groups=len(e.committed), groups=len(e.groups),
                         **getattr(self, "staging", {}))
            broken = e.broken
        except BaseException as e:  # noqa: BLE001 - this worker alone (the full path, a bug): the group is lost
            if self.target is not None:
                self.target.abort()
            what = str(e) if isinstance(e, GroupBroken) else \
                f"refit rank {self.refit_rank} ({self.role}): {type(e).__name__}: {e}"
            if not isinstance(e, GroupBroken):  # told to every peer, which would otherwise wait for its bytes
                try:
                    self.group.fail(what, (self.refit_rank,))
                except GroupBroken:
                    pass
            stats["error"] = what + ("; vLLM's reload wrote the layers that arrived in place: this worker may hold "
                                     "part of the update" if self.path == "full" else
                                     "; the open group keeps its previous weights")
            broken = True
        stats["seconds"] = time.perf_counter() - t0
        self.last_stats = stats
        self.updated = True
        if not broken:
            try:
                self.group.all_gather_object(stats, what=NUMBERS)  # the trainer collects every worker's numbers
            except GroupBroken as e:
                stats["error"] = f"{e} (after this worker's update{' failed' if stats['error'] else ' landed'})"
                broken = True
        if broken:  # nobody to exchange numbers with: the next update needs a new init
            self.group.close()
            self.group = None
            stats["error"] += "; init the transfer engine again before the next update"
        if stats["error"]:  # the trainer raises it; vLLM's session stays open until its finish (see above)
            _log.warning("reshard: %s: %s", self.role, stats["error"])

    def _receive(self, update_info: ReshardUpdateInfo) -> dict:
        """One update's bytes into the model; this worker's numbers."""
        if self.path == "full":
            got = full.receive_full(self.group, self.src, self.dst, self.model, self.device)
            return {"bytes_received": got, "direct_bytes": 0, "processed_bytes": got}
        self.target.reset_stats()
        try:
            rs = self.refit(verify_checksums=update_info.verify, stage=self.target,
                            resume_layer=update_info.resume_layer)
        finally:
            self.staging = self._staging()
        return {"bytes_received": rs.bytes_received,
                "direct_bytes": max(0, rs.bytes_received - self.target.through_bytes),  # staged ones: not in place
                "forwarded_bytes": rs.bytes_sent, "checksum": rs.checksum,
                "processed_bytes": self.target.staged_bytes, "processing_seconds": self.target.processing_seconds,
                "checksums_ok": rs.checksums_ok, "groups": rs.groups, "committed_groups": rs.groups,
                "first_group": rs.first_group, "not_refit": self._not_refit(),
                **self.staging}

    def _not_refit(self) -> list[str]:
        """What this engine computes with that the refit does not move: a speculative draft's weights (its
        MTP layers, or a draft model of its own), named in every update's numbers."""
        method = compat.speculative_method(self.vllm_config)
        if method is None:
            return []
        mtp = not_refit(self.dst.manifest.config)
        return mtp or [f"the speculative draft ({method}): its weights are not in the refit's manifest and stay as "
                       f"the engine loaded them"]

    def _staging(self) -> dict:
        """What this update staged: the measured peak, the budget, the largest layer and group, all the
        worker's checkpoint-format weights."""
        t = self.target
        return {"peak_staged_bytes": t.peak_staged_bytes, "stage_budget_bytes": self.refit.stage_bytes,
                "largest_group_bytes": t.largest_group_bytes, "largest_layer_bytes": t.largest_layer_bytes,
                "worker_weight_bytes": t.weight_bytes}

    def update_weights(self, update_info) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU or GPU: the refit synchronizes

    def finish_weight_update(self) -> None:
        """Ends the update on vLLM's side too, so it always succeeds: also after a failure that gave the
        group up (vLLM refuses the next start until a finish)."""
        self.update_open = False
        if getattr(self, "path", None) == "full":
            views = cpu_repairs.view_buffers(self.model)  # (before vLLM's finalize swaps the parameters back)
            try:
                compat.finish_reload(self.model, self.model_config)
            finally:
                cpu_repairs.unpatch(getattr(self, "patched", []))
                self.patched = []
            cpu_repairs.reprocess_tied(getattr(self, "tied_owners", []))  # from the new values of what they share
            cpu_repairs.resync_views(views)
        elif getattr(self, "target", None) is not None:
            self.target.abort()  # nothing open after an update; a start without an update leaves nothing either

    def _ready(self) -> bool:
        """Whether the engine can take an update call; otherwise the call is refused (`_refuse`)."""
        if getattr(self, "group", None) is None:
            self._refuse("init_weight_transfer_engine first")
            return False
        return True

    def _refuse(self, why: str) -> None:
        """Refuse the call in one line, from the executor's last worker only (the others return: see the module
        docstring); vLLM then ends its session on that worker, which the trainer's finish settles."""
        if self.reporter:
            self.update_open = False
            raise RuntimeError(f"reshard: {self.role}: {why}")

    def shutdown(self) -> None:
        if getattr(self, "group", None) is not None:
            self.group.close()
        self.refit = self.group = self.target = None


def worker_role(dst, replica: int, local: int, worker: int) -> str:
    """What a worker is called in lines: its replica and its rank in it when the layout is a fleet."""
    if fleet_of(dst).replicas == 1 and replica == 0:
        return f"vLLM worker {worker}"
    return f"vLLM replica {replica} worker {local}"


def check_deployment(dst, parallel_config, worker: int, replica: int = 0) -> None:
    """The destination layout must describe this vLLM deployment: format, sizes, expert parallelism (and,
    where it spans the replicas, whether MoE runs sequence-parallel), and a replica the layout has (its `dp`)."""
    if dst.format != "vllm":
        raise ConfigError(f"the engine's layout must have `format: vllm`, not {dst.format!r}", key="dst")
    mesh = next(iter(dst.meshes.values()))
    sizes = dict(zip(mesh.dims, mesh.shape))
    runs = compat.parallel_sizes(parallel_config)
    for dim in ("tp", "pp"):
        if sizes.get(dim, 1) != runs[dim]:
            raise ConfigError(f"the layout has {dim} {sizes.get(dim, 1)}, the engine runs {dim} {runs[dim]}",
                              key="dst")
    if bool(dst.experts) != runs["ep"] and any(".experts." in t.name for t in dst.manifest.tensors):
        raise ConfigError(f"the layout {'has' if dst.experts else 'has no'} expert parallelism, the engine "
                          f"{'does not' if dst.experts else 'does'}", key="dst")
    _check_all2all(dst, runs)
    fleet = fleet_of(dst)
    if replica >= fleet.replicas:
        raise ConfigError(f"this engine's data-parallel rank is replica {replica} of the fleet, the layout has "
                          f"{fleet.replicas} (dp {fleet.replicas})", key="dst")
    if worker >= dst.size:
        raise ConfigError(f"vLLM worker {worker} has no rank in the layout ({dst.size} ranks)", key="dst")


def _check_all2all(dst, runs: dict) -> None:
    """With experts over the replicas, the layout's all2all backend must agree with the engine's on whether MoE
    layers run sequence-parallel: that decides whether each rank keeps shared experts whole or TP-sharded."""
    if "dp" not in (dst.experts or ()):
        return
    mine = dst.engine.get("all2all_backend") or ALL2ALL_DEFAULT
    if ALL2ALL.get(runs["all2all"]) != ALL2ALL[mine]:
        how = {True: "sequence-parallel", False: "not sequence-parallel", None: "unknown to this reshard"}
        raise ConfigError(f"the engine runs MoE all2all backend {runs['all2all']!r} "
                          f"({how[ALL2ALL.get(runs['all2all'])]}), the layout {mine!r} ({how[ALL2ALL[mine]]}): set "
                          f"`engine.all2all_backend: {runs['all2all']}` in it", key="dst")


def _reports_failures(parallel_config, local: int) -> bool:
    """Whether this worker (`local`: its rank inside its data-parallel rank) raises an agreed failure to vLLM:
    only each executor's last worker does (see the module docstring), so vLLM reads every other worker's reply
    before the failure."""
    return local == compat.workers_per_replica(parallel_config) - 1
