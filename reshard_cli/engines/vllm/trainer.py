"""The `reshard` trainer engine and its weight source: what `WeightTransferTrainerFactory.trainer_init` builds on
every trainer rank. Importing it needs vLLM (its base classes).

Every trainer rank joins the refit group; rank 0 drives vLLM's handshake through the client (init, start,
update, finish), running each blocking call beside its own part of the transfer, and one `Refit` in mode
reshard moves only the intersections (`path: full`: the baseline in `full`). The fleet (several engines,
members joining, dropped and told what they hold) is `engines.fleet.members.FleetTrainer`'s, whatever the
engine; vLLM's engines are reached through `clients.VLLMMember`.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from reshard_cli import formats
from reshard_cli.engines.fleet.client import Call
from reshard_cli.engines.fleet.handshake import (NUMBERS, digest, domain_key, handshake, layouts, rank_names,
                                                 refit_topology)
from reshard_cli.engines.fleet.members import FleetTrainer, fleet_report
from reshard_cli.engines.vllm import compat, full
from reshard_cli.engines.vllm.clients import VLLMMember
from reshard_cli.engines.vllm.info import ReshardTrainerInitInfo
from reshard_cli.engines.vllm.plugin import ENGINE
from reshard_cli.errors import ConfigError
from reshard_cli.plan.fleet import fleet_figures, fleet_of
from reshard_cli.plan.groups import stage_budget_mb
from reshard_cli.transfer.comm import refit_group
from reshard_cli.transfer.live import Refit, RefitFailed
from reshard_cli.transfer.watchdog import GroupBroken

_api = compat.transfer_api()


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


class ReshardTrainerEngine(FleetTrainer, _api.TrainerWeightTransferEngine):
    """Trainer side: every trainer rank joins the refit group; rank 0 drives vLLM's handshake through
    the client (an `LLM`, `HTTPVLLMWeightSyncClient`, or anything with the four methods), running each
    blocking call beside its own part of the transfer.

    A fleet: `client` may be a list, one client per engine (several servers or `LLM`s), whose replicas the
    layout's `dp` lists in order; each engine covers as many replicas as its client's `replicas` says (vLLM's
    data parallelism inside one server; `LLMClient` and `reshard run` set it), one otherwise. One refit then
    moves the weights into every replica: the trainer sends each byte once per NVLink domain (`topology`),
    the replicas of a domain forward the rest to each other. Membership (`add`, `remove`), drop-and-resume
    (`send_weights`) and `settle` are `FleetTrainer`'s."""

    init_info_cls = ReshardTrainerInitInfo
    member = VLLMMember
    engine_name = ENGINE

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError("reshard: pass source= (a ReshardSource or vLLM's ModuleSource)")
        clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self = cls(client=clients[0], source=source, is_sender=init_info.is_sender)
        self._fleet_init(init_info)
        self._form(init_info, clients if self.is_sender else [])
        return self

    def _form(self, init_info, clients: list) -> None:
        """Join the refit group with these clients' engines (rank 0; the other trainer ranks pass none) as the
        fleet: the layout's `dp` is theirs (`init_info.dst`)."""
        self._seat(clients)
        self.info, self._fleet_figures = init_info, None
        trainer_size = dist.get_world_size() if dist.is_initialized() else 1
        src, dst = layouts(init_info.src, init_info.dst, trainer_size)
        trainer_size = src.size if src is not None else trainer_size
        world = init_info.world_size or trainer_size + dst.size
        refit_topology(init_info.topology, [])  # a bad topology fails here, on every trainer rank, before any call
        worker_info = _worker_info(init_info, world, trainer_size)
        refused = self._place_members(dst, trainer_size)  # clients that do not fit the layout: no engine is called
        # the workers' init calls block until the group forms: run them beside this rank's own joining
        calls = [Call(c.init_weight_transfer_engine, {**worker_info, "replica": first})
                 for c, first in zip(self.clients, self._replicas.bases)]
        tensors = self._tensors()
        try:
            self.group = refit_group(init_info.host, init_info.port, init_info.rank, world,
                                     timeout=init_info.timeout, device=_device_of(tensors),
                                     abort=lambda: refused or next((f for f in (c.failure() for c in calls) if f),
                                                                   None),
                                     names=rank_names(dst, self.engine_name), stall=init_info.stall or None)
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
                               domain_key(init_info.topology, _device_of(tensors)),
                               settings={"transport": init_info.transport})
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
        self._seated(agreed.open_updates)
        self.refit = (Refit(role="src", src=src, dst=dst, mode=init_info.mode, topology=topology,
                            bucket_mb=init_info.bucket_mb, group=self.group,
                            stage_mb=stage_budget_mb(dst, init_info.stage_mb), who=f"trainer {init_info.rank}",
                            transport=init_info.transport)
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
        self._tell_outcome(calls, failure, late, weight_version, complete=failure is None and failed is None)
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
                # (the full path has no commit: a trainer rank that sends nothing learns of a worker's failure
                # here, and says what the sender says)
                line = f"{e} (after the update)" if self.refit is not None else str(e)
                failure = RefitFailed(line, done, groups, broken=True, ranks=e.ranks, line=line)
        if failure is not None and self.refit is not None:
            failure.held, failure.torn = self.refit.held(), self.refit.torn()
        elif failure is not None:
            full.tear(failure, self.dst)
        return failure, everyone, mine

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
            self._leave_members()
        self.refit = self.group = None


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


def _worker_info(init_info, world: int, trainer_size: int) -> dict:
    """What every engine worker's `init_weight_transfer_engine` is given (its replica's first rank is added per
    engine): where the refit group meets, its size, the layouts and the refit's settings."""
    return {"host": init_info.host, "port": init_info.port, "world_size": world, "src": init_info.src,
            "dst": init_info.dst, "trainer_size": trainer_size, "timeout": init_info.timeout,
            "bucket_mb": init_info.bucket_mb, "path": init_info.path, "stage_mb": init_info.stage_mb,
            "topology": init_info.topology, "mode": init_info.mode, "stall": init_info.stall,
            "transport": init_info.transport}


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    return next((x.device for x in tensors.values()), torch.device("cpu"))
