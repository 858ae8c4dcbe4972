"""The `reshard` trainer engine and its weight source: what `WeightTransferTrainerFactory.trainer_init` builds on
every trainer rank. Importing it needs vLLM (its base classes).

Every trainer rank joins the refit group; rank 0 drives vLLM's handshake through the client (init, start,
update, finish), running each blocking call beside its own part of the transfer, and one `Refit` in mode
reshard moves only the intersections (`path: full`: the baseline in `full`).
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from reshard_cli import formats
from reshard_cli.engines.vllm import compat, full
from reshard_cli.engines.vllm.clients import Call
from reshard_cli.engines.vllm.handshake import digest, handshake, layouts, stage_mb
from reshard_cli.engines.vllm.info import ReshardTrainerInitInfo
from reshard_cli.errors import ConfigError
from reshard_cli.transfer.comm import refit_group
from reshard_cli.transfer.live import Refit, RefitFailed
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
    blocking call beside its own part of the transfer."""

    init_info_cls = ReshardTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError("reshard: pass source= (a ReshardSource or vLLM's ModuleSource)")
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        trainer_size = dist.get_world_size() if dist.is_initialized() else 1
        src, dst = layouts(init_info.src, init_info.dst, trainer_size)
        trainer_size = src.size if src is not None else trainer_size
        world = init_info.world_size or trainer_size + dst.size
        worker_info = {"host": init_info.host, "port": init_info.port, "world_size": world,
                       "src": init_info.src, "dst": init_info.dst, "trainer_size": trainer_size,
                       "timeout": init_info.timeout, "bucket_mb": init_info.bucket_mb, "path": init_info.path,
                       "stage_mb": init_info.stage_mb}
        # the workers' init call blocks until the group forms: run it beside this rank's own joining
        call = Call(client.init_weight_transfer_engine, worker_info) if self.is_sender else None
        tensors = self._tensors()
        self.group = refit_group(init_info.host, init_info.port, init_info.rank, world,
                                 timeout=init_info.timeout, device=_device_of(tensors),
                                 abort=call.failure if call is not None else None)
        error = _own_error(src, tensors, init_info.rank)
        try:
            stage_mb(init_info.stage_mb, dst)
        except ConfigError as e:
            error = error or str(e)
        try:
            handshake(self.group, f"trainer {init_info.rank}",
                      digest(src, None if src is not None or error else tensors), error)
        finally:
            if call is not None:
                call.join()
        self.src, self.dst = src, dst
        self.refit = (Refit(role="src", src=src, dst=dst, mode="reshard", bucket_mb=init_info.bucket_mb,
                            group=self.group, stage_mb=stage_mb(init_info.stage_mb, dst),
                            who=f"trainer {init_info.rank}") if init_info.path == "reshard" else None)
        return self

    def _tensors(self) -> Mapping[str, torch.Tensor]:
        src = self.source
        if hasattr(src, "tensors"):
            return src.tensors()
        params = compat.module_source_params(src)
        if params is None:
            raise ValueError("reshard: the source must be a ReshardSource or vLLM's ModuleSource")
        return params

    def send_weights(self, weight_version: str | None = None) -> dict:
        """One refit into the engine; every worker's numbers and this rank's, as a dict. The engine's weight
        version becomes `weight_version` when every group was committed; unchanged when none was; a partial
        marker (`<version>+partial-<k>of<n>`) when a failure left the first k of n groups new. A failure raises
        one line on every trainer rank, after the engine has been told to finish the update."""
        if self.group is None:
            raise RuntimeError("reshard: the refit group was given up after a failure: trainer_init again")
        tensors = self._tensors()
        if self.is_sender:
            self._start_update()
            call = Call(self.client.update_weights, {"verify": self.info.verify})
        t0 = time.perf_counter()
        failure: RefitFailed | None = None
        everyone, mine = [], {"bytes_sent": 0, "checksums_ok": None}
        try:
            try:
                mine = self._send(tensors)
            except RefitFailed as e:  # the same line on every rank that saw it
                failure = e
            except GroupBroken as e:  # a rank died or stalled outside the groups (the full path)
                failure = RefitFailed(str(e), [], [], broken=True, ranks=e.ranks)
            if failure is None or not failure.broken:
                try:
                    everyone = self.group.all_gather_object(None)  # the workers' stats, after their update
                except GroupBroken as e:  # after the update: what it committed stays committed
                    done = self.refit.groups if failure is None and self.refit is not None else \
                        (failure.committed if failure is not None else [])
                    failure = RefitFailed(f"{e} (after the update)", done, self.refit.groups if self.refit else [],
                                          broken=True, ranks=e.ranks)
        finally:
            if self.is_sender:
                try:
                    call.join()
                except RuntimeError:
                    pass  # the workers' own error, gathered above, says more
        seconds = time.perf_counter() - t0
        workers = [s for s in everyone if s is not None]
        failed = next((w for w in workers if w["error"]), None)
        version = weight_version
        landed = failure is not None and failure.groups and len(failure.committed) == len(failure.groups)
        if failure is not None and not landed:  # unchanged, or the partial marker
            version = (None if not failure.partial else
                       f"{weight_version or 'update'}+partial-{len(failure.committed)}of{len(failure.groups)}")
        if self.is_sender:
            changed = failure is None or failure.partial
            self._finish_update(version, failure is None and failed is None, changed=changed)
        if failure is not None:
            if failure.broken:  # the group is given up: the next refit needs a new trainer_init
                self.shutdown()
            raise UpdateFailed(f"reshard: {failure}", failure) from None
        if failed:
            raise RuntimeError(f"reshard: refit rank {failed['worker']} (vLLM worker): {failed['error']}")
        return {"seconds": seconds, "trainer": mine, "workers": workers, "weight_version": version}

    def _finish_update(self, version: str | None, ok: bool, *, changed: bool) -> None:
        """The engine's finish_weight_update, and what a changed model needs: the new weight version, and the
        prefix cache dropped (the KV of earlier prompts was computed with the old weights, and vLLM does not
        drop it on a weight update). After a failure vLLM has already ended the update on the worker that
        reported it, so its finish is expected to fail there; the version is then set on its own."""
        if ok:
            self.client.finish_weight_update(version)
        else:
            _quietly(self.client.finish_weight_update, None)
            setter = getattr(self.client, "update_weight_version", None)
            if version is not None and setter is not None:
                setter(version)
        reset = getattr(self.client, "reset_prefix_cache", None)
        if reset is not None and changed:
            reset()

    def _start_update(self) -> None:
        """The engine's start_weight_update. An update left open (a trainer that died before finishing it, a
        failure vLLM ended on some workers only) is finished first: vLLM refuses to start one while another
        is active."""
        try:
            self.client.start_weight_update()
        except Exception:  # noqa: BLE001 - vLLM's RuntimeError, or an HTTP 500 carrying it
            _quietly(self.client.finish_weight_update, None)
            self.client.start_weight_update()

    def _send(self, tensors: Mapping[str, torch.Tensor]) -> dict:
        """This rank's part of one update: the refit, or the full path's tensors."""
        if self.refit is not None:
            rs = self.refit(tensors, verify_checksums=self.info.verify)
            return {"bytes_sent": rs.bytes_sent, "checksums_ok": rs.checksums_ok, "groups": rs.groups}
        sent = full.send_full(self.group, tensors, self.src, self.dst, self.info.rank)
        return {"bytes_sent": sent, "checksums_ok": None}

    def shutdown(self) -> None:
        if getattr(self, "group", None) is not None:
            self.group.close()
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


def _quietly(fn, *args) -> None:
    """A control-plane call whose failure is expected and says nothing new (a finish where vLLM already ended
    the update)."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    return next((x.device for x in tensors.values()), torch.device("cpu"))
