"""reshard as a vLLM weight-transfer backend: the worker engine inside vLLM, the trainer engine beside it.

pyproject.toml declares `reshard = "reshard_cli.engines.vllm.backend:register"` in the `vllm.general_plugins`
group, so every vLLM process (the engine core and its workers) registers the backend `reshard` in vLLM's
`WeightTransferEngineFactory` and `WeightTransferTrainerFactory`; `LLM(..., weight_transfer_config={"backend":
"reshard"})` and `vllm serve ... --weight-transfer-config '{"backend": "reshard"}'` then build
`ReshardWorkerEngine` in each worker.

Trainer side (every trainer rank, after its own `init_process_group`):

    engine = WeightTransferTrainerFactory.trainer_init(
        ReshardTrainerInitInfo(host=..., port=..., dst=open("infer.yaml").read(), rank=rank),
        client=llm_or_HTTPVLLMWeightSyncClient, source=ReshardSource(lambda: dict(model.named_parameters())))
    report = engine.send_weights()          # after each optimizer step

The trainer's rank 0 drives vLLM's handshake through the client (init, start, update, finish); every trainer
rank and every vLLM worker meet in a refit group of their own (`transfer.comm.refit_group`: gloo on CPU, NCCL
on GPUs; never vLLM's process group), and one `Refit` in mode reshard moves only the intersections.

Worker side, per update:
  init        check the engine's layout against vLLM's parallel config and its model (every parameter covered,
              every view the right shape), join the refit group, and agree with every trainer rank on the
              model (names, shapes, dtypes) — any mismatch fails the init call on all sides with one line,
              before a byte moves.
  start       modules vLLM post-processes after loading (those with a quant method: linear layers, experts,
              embeddings) are staged as vLLM's layerwise reload does it: their parameters are materialized
              in checkpoint format (this worker's shards: fused qkv/gate_up, stacked experts, padded vocab);
              modules without (norms) are written in their own parameters.
  update      the refit writes every received piece straight into those views (no full tensor, no
              `load_weights`); then vLLM's own post-processing turns each staged module into its kernel format
              and copies it into the storage the kernels use (the CPU build repacks linear weights; quantized
              schemes quantize). With `verify`, every shard's checksum is compared with the sources'.
  finish      vLLM's `finalize_layerwise_reload` on the staged modules (a module the update did not reach
              keeps its previous weights).

A failed update puts the staged modules back on their previous weights and says so; norms written before the
failure stay written, and the error says that too.

`path: full` in the init info is the baseline vLLM's own backends implement: the trainer's rank 0 gathers every
full tensor and sends it to every worker, which loads it with vLLM's `load_weights` under layerwise reload.
It exists to be measured against (examples/vllm_refit.py).
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping

import torch

from reshard_cli.errors import ConfigError, ReshardError

BACKEND = "reshard"


def register() -> None:
    """vLLM plugin entry point: register both engines (idempotent; vLLM may call it more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "ReshardWorkerEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "ReshardTrainerEngine")


# ------------------------------------------------------------------------------------------ handshake


def _digest(layout=None, tensors: Mapping[str, torch.Tensor] | None = None) -> list | None:
    """A model as sorted (name, global shape, dtype) triples: from a layout, or from DTensors' global shapes."""
    if layout is not None:
        return sorted((t.name, tuple(t.shape), t.dtype) for t in layout.manifest.tensors)
    if tensors is not None:
        return sorted((n, tuple(x.shape), str(x.dtype).removeprefix("torch.")) for n, x in tensors.items())
    return None


def handshake(comm, role: str, model, error: str | None) -> None:
    """Collective over the refit group: every rank says its role, a hash of its model (None: derived from
    DTensors later) and whether its own checks passed. Every rank raises the same one-line ConfigError if any
    failed or two models differ, so no side waits for a transfer that will not come. Only when the hashes
    differ do the ranks exchange the models themselves, to name the first difference."""
    import hashlib

    digest = hashlib.sha256(repr(model).encode()).hexdigest() if model is not None else None
    everyone = comm.all_gather_object({"role": role, "model": digest, "error": error})
    for r, x in enumerate(everyone):
        if x["error"]:
            raise ConfigError(f"refit rank {r} ({x['role']}): {x['error']}")
    if len({x["model"] for x in everyone if x["model"] is not None}) < 2:
        return
    models = [(r, m) for r, m in enumerate(comm.all_gather_object(model)) if m is not None]
    for r, m in models[1:]:
        r0, m0 = models[0]
        if m != m0:
            a, b = dict((n, (s, d)) for n, s, d in m0), dict((n, (s, d)) for n, s, d in m)
            missing = sorted(set(a) ^ set(b))
            what = (f"{missing[0]!r} is in one model only" if missing else
                    next(f"{n}: {list(a[n][0])} {a[n][1]} vs {list(b[n][0])} {b[n][1]}" for n in a if a[n] != b[n]))
            raise ConfigError(f"refit ranks {r0} ({everyone[r0]['role']}) and {r} ({everyone[r]['role']}) have "
                              f"different models: {what}", key="model")


# ------------------------------------------------------------------------------------ engine storage


class EngineTarget:
    """Where one vLLM worker's bytes land, and vLLM's post-processing after they landed.

    `direct`: modules without a quant method (norms): the refit writes into their parameters.
    `staged`: modules vLLM post-processes after loading; per update they are materialized in checkpoint format
    through vLLM's layerwise-reload bookkeeping, written by the refit, then processed and copied into the
    kernels' storage by vLLM's own code (`_layerwise_process`, the step its reload runs once a layer's
    weights are all loaded). A module in a kernel format may look unchanged from outside (the CPU build keeps
    the experts' shapes but prepacks them), so every module with a quant method is staged."""

    def __init__(self, model, layout, rank: int, model_config):
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        from reshard_cli.formats import vllm as fmt

        self.model, self.layout, self.rank, self.model_config = model, layout, rank, model_config
        self.storage = fmt.storage(layout, rank)
        params = dict(model.named_parameters())
        expected = {et.name for et in self.storage}
        extra = sorted(set(params) - expected)
        if extra:  # a parameter no checkpoint tensor fills would keep stale weights: refuse
            raise ConfigError(f"rank {rank}: engine parameter {extra[0]!r} is not filled by any checkpoint tensor "
                              f"of the layout ({len(extra)} such)", key="dst")
        self.staged: dict[str, torch.nn.Module] = {}
        for et in self.storage:
            mod_name = et.name.rpartition(".")[0]
            module = model.get_submodule(mod_name)
            if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
                self.staged[mod_name] = module
        # modules sharing a staged module's parameter (a tied lm_head shares the embedding's): their kernels
        # were built from it, so vLLM's post-processing runs on them again once the new values are in
        shared = {id(p) for m in self.staged.values() for p in m._parameters.values() if p is not None}
        staged = {id(m) for m in self.staged.values()}
        self.tied = [m for m in model.modules() if id(m) not in staged
                     and isinstance(getattr(m, "quant_method", None), QuantizeMethodBase)
                     and any(id(p) in shared for p in m._parameters.values() if p is not None)]
        # tensors whose engine storage has rows no checkpoint byte fills (a padded vocab): zeroed when staged,
        # as vLLM's own loader zeroes them
        self.padded = {et.name for et in self.storage
                       if sum(v.box.numel for v in et.views) < _numel(et.shape)}
        self.views: dict | None = None
        self.active = False  # staged modules are materialized (between start and update/finish)
        # every view checked now, against the live parameters and the staged ones' checkpoint-format metadata
        fmt.bind(self._model_format(params), layout, rank)

    def _model_format(self, params: dict) -> dict:
        """The parameters in checkpoint format: live ones, or the staged modules' recorded metadata."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        out = dict(params)
        for mod_name, module in self.staged.items():
            meta = get_layerwise_info(module).restore_metadata[0]
            for pname in module._parameters:
                if pname in meta:
                    out[f"{mod_name}.{pname}"] = meta[pname]
        return out

    @property
    def staged_bytes(self) -> int:
        return sum(et.nbytes for et in self.storage if et.name.rpartition(".")[0] in self.staged)

    def begin(self) -> None:
        """Materialize the staged modules in checkpoint format and bind every view (start of an update)."""
        from vllm.model_executor.model_loader.reload.layerwise import (get_layerwise_info,
                                                                       initialize_layerwise_reload)
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        from reshard_cli.formats import vllm as fmt

        if self.active:
            raise RuntimeError("reshard: start_weight_update twice without an update in between")
        for module in self.staged.values():
            initialize_layerwise_reload(module)
            materialize_layer(module, get_layerwise_info(module))
        self.active = True
        params = dict(self.model.named_parameters())
        for name in self.padded:
            if name.rpartition(".")[0] in self.staged:
                params[name].data.zero_()
        self.views = fmt.bind(params, self.layout, self.rank)

    def commit(self) -> float:
        """vLLM's post-processing of every staged module (after the refit wrote it); its seconds."""
        from vllm.model_executor.model_loader.reload import layerwise

        t0 = time.perf_counter()
        for module in self.staged.values():
            layerwise._layerwise_process(module, layerwise.get_layerwise_info(module))
            _repack_experts(module)
        for module in self.tied:
            module.quant_method.process_weights_after_loading(module)
        self.active, self.views = False, None
        return time.perf_counter() - t0

    def end(self) -> None:
        """vLLM's finalize on the staged modules: a module not committed gets its previous kernel tensors back."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        for module in self.staged.values():
            finalize_layerwise_reload(module, self.model_config)
        self.active, self.views = False, None


def _repack_experts(module) -> None:
    """vLLM 0.32 prepacks the CPU build's MoE weights (same shape, the grouped GEMM's layout) when a model is
    first loaded, but its update path (`_setup_kernel` once a kernel exists, which its own `reload_weights`
    takes too) leaves them in checkpoint layout, so an updated MoE computes with wrongly laid-out experts.
    After vLLM's processing, run the experts kernel's own packing step again, as the first load does."""
    quant = getattr(module, "quant_method", None)
    fused = getattr(getattr(quant, "moe_kernel", None), "fused_experts", None)
    if fused is None or getattr(module, "w13_weight", None) is None or module.w13_weight.device.type != "cpu":
        return
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    if type(fused).process_weights_after_loading is not FusedMoEExperts.process_weights_after_loading:
        fused.process_weights_after_loading(module)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------------- the full-tensor path


def full_senders(src, manifest) -> list[int]:
    """Per tensor of `manifest`, the refit rank that sends it whole on the full path: the first trainer rank
    holding the whole tensor, else rank 0 after gathering it (then every trainer rank holds a DTensor)."""
    if src is None:
        return [0] * len(manifest.tensors)
    whole: dict[str, int] = {}
    for r in src.ranks:
        for t, box in src.held(r):
            spec = src.manifest.tensors[t]
            if tuple(box.sizes) == tuple(spec.shape):
                whole.setdefault(spec.name, r)
    return [whole.get(t.name, 0) for t in manifest.tensors]


def _send_full(comm, tensors: Mapping[str, torch.Tensor], src, dst, rank: int) -> int:
    """The baseline's trainer side: every full tensor, from its sender to every worker, in the engine's
    manifest order (DTensors are gathered over the trainer's own group first). Returns the bytes this rank
    sent."""
    from torch.distributed.tensor import DTensor

    sent = 0
    for spec, sender in zip(dst.manifest.tensors, full_senders(src, dst.manifest)):
        x = tensors.get(spec.name)
        if isinstance(x, DTensor):
            x = x.full_tensor()  # collective over the trainer's group, on every trainer rank
        if rank != sender:
            continue
        if x is None or tuple(x.shape) != tuple(spec.shape):
            raise ConfigError(f"the full path needs {spec.name} whole on trainer rank {rank} or as a DTensor",
                              key=spec.name)
        x = x.detach().contiguous()
        for w in dst.ranks:
            comm.isend(x, w).wait()
            sent += x.numel() * x.element_size()
    return sent


def _receive_full(comm, src, dst, model, device) -> int:
    """The baseline's worker side: receive every full tensor and hand it to vLLM's `load_weights`."""
    got = 0
    for spec, sender in zip(dst.manifest.tensors, full_senders(src, dst.manifest)):
        buf = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
        comm.irecv(buf, sender).wait()
        got += buf.numel() * buf.element_size()
        model.load_weights([(spec.name, buf)])
    return got


# ------------------------------------------------------------------------------------- vLLM's classes


def _classes():
    from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine, WeightSource,
                                                       WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclass
    class ReshardInitInfo(WeightTransferInitInfo):
        host: str
        port: int
        world_size: int  # trainer ranks + the engine's workers, the ranks the layouts name
        dst: str  # the engine's layout, YAML text, `format: vllm`; its i-th rank is vLLM worker i
        src: str = ""  # the trainer's layout, YAML text; empty: read from the trainer's DTensors
        trainer_size: int = 0  # with no src: the trainer's ranks (the engine's ranks follow them)
        timeout: float = 300.0
        bucket_mb: float = 64.0
        path: str = "reshard"  # or "full": the baseline (full tensors to every worker, then load_weights)

    @dataclass
    class ReshardUpdateInfo(WeightTransferUpdateInfo):
        verify: bool = True

    class ReshardWorkerEngine(WeightTransferEngine):
        init_info_cls = ReshardInitInfo
        update_info_cls = ReshardUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
            import torch.distributed as dist

            from reshard_cli.transfer.comm import refit_group
            from reshard_cli.transfer.live import Refit

            if init_info.path not in ("reshard", "full"):
                raise ValueError(f"reshard: path must be 'reshard' or 'full', not {init_info.path!r}")
            self.shutdown()
            worker = dist.get_rank() if dist.is_initialized() else 0
            error, src, dst = None, None, None
            try:
                src, dst = _layouts(init_info.src, init_info.dst, init_info.trainer_size)
                check_deployment(dst, self.parallel_config, worker)
                self.refit_rank = dst.ranks[worker]
                if init_info.path == "reshard":
                    self.target = EngineTarget(self.model, dst, self.refit_rank, self.model_config)
            except ReshardError as e:
                if dst is None or worker >= dst.size:
                    raise ValueError(f"reshard: {e}") from None  # no rank to tell the others from
                error = str(e)
                self.refit_rank = dst.ranks[worker]
            group = refit_group(init_info.host, init_info.port, self.refit_rank, init_info.world_size,
                                timeout=init_info.timeout, device=self.device)
            try:
                handshake(group, f"vLLM worker {worker}", _digest(dst), error)
            except ReshardError as e:
                self.target = None
                raise ValueError(f"reshard: {e}") from None
            self.group, self.src, self.dst, self.path = group, src, dst, init_info.path
            self.refit = None
            if self.path == "reshard":
                self.refit = Refit(role="dst", src=src, dst=dst, mode="reshard", bucket_mb=init_info.bucket_mb,
                                   group=group, device=self.device)
            self.last_stats = None
            self.updated = False

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self._ready()
            if self.path == "full":
                initialize_layerwise_reload(self.model)
            else:
                self.target.begin()
            self.updated = False

        def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
            self._ready()
            if self.updated:
                raise RuntimeError("reshard: one update_weights per start_weight_update (it moves every tensor)")
            t0 = time.perf_counter()
            stats = {"worker": self.refit_rank, "error": None}
            try:
                if self.path == "full":
                    got = _receive_full(self.group, self.src, self.dst, self.model, self.device)
                    stats.update(bytes_received=got, direct_bytes=0, processed_bytes=got)
                else:
                    try:
                        rs = self.refit(self.target.views, verify_checksums=update_info.verify)
                    except BaseException as e:
                        raise RuntimeError(f"the refit failed ({type(e).__name__}: {e})") from e
                    if update_info.verify and not rs.checksums_ok:
                        raise RuntimeError("checksums differ after the refit")
                    processing = self.target.commit()
                    stats.update(bytes_received=rs.bytes_received, direct_bytes=rs.bytes_received,
                                 processed_bytes=self.target.staged_bytes, processing_seconds=processing,
                                 checksums_ok=rs.checksums_ok)
            except BaseException as e:  # noqa: BLE001 - told to every rank, then raised
                if self.target is not None:
                    self.target.end()  # staged modules back on their previous weights
                stats["error"] = (f"{e}; modules vLLM repacks keep their previous weights, the others (norms) may "
                                  f"be partly new: update again")
            stats["seconds"] = time.perf_counter() - t0
            self.last_stats = stats
            self.updated = True
            self.group.all_gather_object(stats)  # the trainer collects every worker's numbers (or errors)
            if stats["error"]:
                raise RuntimeError(f"reshard: {stats['error']}")

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # CPU or GPU: the refit synchronizes

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._ready()
            if self.path == "full":
                finalize_layerwise_reload(self.model, self.model_config)
                for module in self.model.modules():  # vLLM's own update path needs the same repair
                    _repack_experts(module)
            else:
                self.target.end()

        def _ready(self) -> None:
            if getattr(self, "group", None) is None:
                raise RuntimeError("reshard: init_weight_transfer_engine first")

        def shutdown(self) -> None:
            self.refit = self.group = self.target = None

    @dataclass
    class ReshardTrainerInitInfo(TrainerInitInfo):
        backend: ClassVar[str] = BACKEND
        host: str = "127.0.0.1"
        port: int = 0
        dst: str = ""  # the engine's layout, YAML text (`format: vllm`, ranks after the trainer's)
        src: str = ""  # the trainer's layout, YAML text; empty: read from the DTensors the source gives
        world_size: int = 0  # 0: the trainer's size (torch.distributed) + the engine's ranks
        timeout: float = 300.0
        bucket_mb: float = 64.0
        path: str = "reshard"
        verify: bool = True

    class ReshardSource(WeightSource):
        """The trainer's tensors by checkpoint name: DTensors as torch's parallelisms make them, or local
        views when a `src` layout says where they sit. `tensors` is called at every update."""

        def __init__(self, tensors: Callable[[], Mapping[str, torch.Tensor]]):
            self.tensors = tensors

        def metadata(self):
            from vllm.distributed.weight_transfer.base import ParamMeta

            return [ParamMeta(n, x.dtype, tuple(x.shape)) for n, x in self.tensors().items()]

        def __iter__(self):
            from torch.distributed.tensor import DTensor

            for n, x in self.tensors().items():
                yield n, (x.full_tensor() if isinstance(x, DTensor) else x)

    class ReshardTrainerEngine(TrainerWeightTransferEngine):
        """Trainer side: every trainer rank joins the refit group; rank 0 drives vLLM's handshake through
        the client (an `LLM`, `HTTPVLLMWeightSyncClient`, or anything with the four methods), running each
        blocking call beside its own part of the transfer."""

        init_info_cls = ReshardTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            import torch.distributed as dist

            from reshard_cli.transfer.comm import refit_group
            from reshard_cli.transfer.live import Refit

            if source is None:
                raise ValueError("reshard: pass source= (a ReshardSource or vLLM's ModuleSource)")
            self = cls(client=client, source=source, is_sender=init_info.is_sender)
            self.info = init_info
            trainer_size = dist.get_world_size() if dist.is_initialized() else 1
            src, dst = _layouts(init_info.src, init_info.dst, trainer_size)
            trainer_size = src.size if src is not None else trainer_size
            world = init_info.world_size or trainer_size + dst.size
            worker_info = {"host": init_info.host, "port": init_info.port, "world_size": world,
                           "src": init_info.src, "dst": init_info.dst, "trainer_size": trainer_size,
                           "timeout": init_info.timeout, "bucket_mb": init_info.bucket_mb, "path": init_info.path}
            # the workers' init call blocks until the group forms: run it beside this rank's own joining
            call = _Call(client.init_weight_transfer_engine, worker_info) if self.is_sender else None
            tensors = self._tensors()
            self.group = refit_group(init_info.host, init_info.port, init_info.rank, world,
                                     timeout=init_info.timeout, device=_device_of(tensors),
                                     abort=call.failure if call is not None else None)
            error = None
            if src is not None:
                named = tensors
                if src.format == "megatron":  # Megatron's own parameters: checked against the layout here
                    from reshard_cli.formats import megatron
                    try:
                        named = megatron.bind(tensors, src, init_info.rank)
                    except ConfigError as e:
                        error = str(e)
                held = {src.manifest.tensors[t].name for t, box in src.held(init_info.rank) if box.numel}
                missing = sorted(held - set(named))
                error = error or (f"the trainer does not hold {missing[0]!r}" if missing else None)
            try:
                handshake(self.group, f"trainer {init_info.rank}",
                          _digest(src, None if src is not None or error else tensors), error)
            finally:
                if call is not None:
                    call.join()
            self.src, self.dst = src, dst
            self.refit = (Refit(role="src", src=src, dst=dst, mode="reshard", bucket_mb=init_info.bucket_mb,
                                group=self.group) if init_info.path == "reshard" else None)
            return self

        def _tensors(self) -> Mapping[str, torch.Tensor]:
            src = self.source
            if hasattr(src, "tensors"):
                return src.tensors()
            module = getattr(src, "_module", None)  # vLLM's ModuleSource
            if module is None:
                raise ValueError("reshard: the source must be a ReshardSource or vLLM's ModuleSource")
            return dict(module.named_parameters())

        def send_weights(self, weight_version: str | None = None) -> dict:
            """One refit into the engine; every worker's numbers and this rank's, as a dict."""
            tensors = self._tensors()
            if self.is_sender:
                self.client.start_weight_update()
                call = _Call(self.client.update_weights, {"verify": self.info.verify})
            t0 = time.perf_counter()
            try:
                if self.refit is not None:
                    rs = self.refit(tensors, verify_checksums=self.info.verify)
                    mine = {"bytes_sent": rs.bytes_sent, "checksums_ok": rs.checksums_ok}
                else:
                    sent = _send_full(self.group, tensors, self.src, self.dst, self.info.rank)
                    mine = {"bytes_sent": sent, "checksums_ok": None}
                everyone = self.group.all_gather_object(None)  # the workers' stats, after their update
            finally:
                if self.is_sender:
                    try:
                        call.join()
                    except RuntimeError:
                        pass  # the workers' own error, gathered above, says more
            seconds = time.perf_counter() - t0
            workers = [s for s in everyone if s is not None]
            failed = next((w for w in workers if w["error"]), None)
            if self.is_sender:
                self.client.finish_weight_update(weight_version)  # a failed worker restores its weights here
                # the KV cache of earlier prompts was computed with the old weights: vLLM does not drop it on
                # a weight update, so a cached prefix would be served from the old model
                reset = getattr(self.client, "reset_prefix_cache", None)
                if reset is not None and not failed:
                    reset()
            if failed:
                raise RuntimeError(f"reshard: refit rank {failed['worker']} (vLLM worker): {failed['error']}")
            return {"seconds": seconds, "trainer": mine, "workers": workers}

        def shutdown(self) -> None:
            self.refit = self.group = None

    return (ReshardInitInfo, ReshardUpdateInfo, ReshardWorkerEngine, ReshardTrainerInitInfo, ReshardSource,
            ReshardTrainerEngine)


class LLMClient:
    """vLLM's client protocol (`VLLMWeightSyncClient`) over an `LLM` in this process, whose own methods take
    request dicts; `HTTPVLLMWeightSyncClient(url)` is the same for a running `vllm serve`."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class _Call:
    """A blocking control-plane call (vLLM's client) run on a thread beside this rank's transfer; `join`
    re-raises its error."""

    def __init__(self, fn, arg):
        self.error = None

        def run():
            try:
                fn(arg)
            except BaseException as e:  # noqa: BLE001 - re-raised by join
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def failure(self) -> str | None:
        """Why the call failed, once it has (polled while waiting for the peers it should have started)."""
        if self.error is None:
            return None
        return f"the engine refused: {_one_line(self.error)}"

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"reshard: {self.failure()}") from self.error


def _one_line(e: BaseException) -> str:
    """An HTTP error with the server's own message, or the first line of any other error."""
    response = getattr(e, "response", None)
    if response is not None:
        try:
            detail = response.json()
            detail = detail.get("error") or detail.get("detail") or detail.get("message") or detail
        except ValueError:
            detail = response.text[:300]
        return f"HTTP {response.status_code} from {response.url}: {detail}"
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def check_engine(url: str, workers: int, timeout: float = 30.0) -> None:
    """A running `vllm serve` at `url` with the weight-transfer routes and as many workers as the layout has
    ranks; otherwise one ConfigError that says which."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/get_world_size?include_dp=true", timeout=timeout) as r:  # noqa: S310
            size = json.loads(r.read())["world_size"]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise ConfigError(f"the engine at {url} does not expose vLLM's weight-transfer routes: start it with "
                              f"VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{{\"backend\": \"reshard\"}}'",
                              key="engine.url") from None
        raise ConfigError(f"the engine at {url} answered HTTP {e.code}", key="engine.url") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        reason = getattr(e, "reason", None) or e
        raise ConfigError(f"cannot reach a vLLM engine at {url}: {reason}", key="engine.url") from None
    if size != workers:
        raise ConfigError(f"the engine at {url} runs {size} workers, the layout has {workers} ranks",
                          key="engine.url")


def http_client(url: str, timeout: float):
    """vLLM's own HTTP client of the weight-transfer routes, which also drops the server's prefix cache."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    class Client(HTTPVLLMWeightSyncClient):
        def reset_prefix_cache(self) -> None:
            self._post("reset_prefix_cache")

    return Client(url, timeout=timeout)


def portable_layout(file: str) -> str:
    """A layout's YAML text for the engine's processes, which may run elsewhere: a model path made absolute,
    the source left out (only this side reads it)."""
    from pathlib import Path

    import yaml

    with open(file) as f:
        doc = yaml.safe_load(f)
    model = doc.get("model")
    if isinstance(model, str) and (Path(file).parent / model).exists():
        doc["model"] = str((Path(file).parent / model).resolve())
    doc.pop("source", None)
    return yaml.safe_dump(doc, sort_keys=False)


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    return next((x.device for x in tensors.values()), torch.device("cpu"))


def _layouts(src_text: str, dst_text: str, trainer_size: int = 0):
    """The two layouts from YAML text (src may be empty: read from DTensors at the first refit; the engine's
    ranks then start after the trainer's `trainer_size` unless its layout says otherwise)."""
    from reshard_cli.formats import load_layout, load_pair

    with tempfile.TemporaryDirectory(prefix="reshard-vllm-") as tmp:
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


def check_deployment(dst, parallel_config, worker: int) -> None:
    """The destination layout must describe this vLLM deployment: format, sizes, expert parallelism."""
    if dst.format != "vllm":
        raise ConfigError(f"the engine's layout must have `format: vllm`, not {dst.format!r}", key="dst")
    mesh = next(iter(dst.meshes.values()))
    sizes = dict(zip(mesh.dims, mesh.shape))
    for dim, have in (("tp", parallel_config.tensor_parallel_size), ("pp", parallel_config.pipeline_parallel_size)):
        if sizes.get(dim, 1) != have:
            raise ConfigError(f"the layout has {dim} {sizes.get(dim, 1)}, the engine runs {dim} {have}", key="dst")
    if bool(dst.experts) != bool(parallel_config.enable_expert_parallel) and any(
            ".experts." in t.name for t in dst.manifest.tensors):
        raise ConfigError(f"the layout {'has' if dst.experts else 'has no'} expert parallelism, the engine "
                          f"{'does not' if dst.experts else 'does'}", key="dst")
    if worker >= dst.size:
        raise ConfigError(f"vLLM worker {worker} has no rank in the layout ({dst.size} ranks)", key="dst")


_NAMES = ("ReshardInitInfo", "ReshardUpdateInfo", "ReshardWorkerEngine", "ReshardTrainerInitInfo", "ReshardSource",
          "ReshardTrainerEngine")


def __getattr__(name: str):
    """The vLLM-dependent classes are built on first use, so importing this module needs no vLLM."""
    if name in _NAMES:
        globals().update(zip(_NAMES, _classes()))
        return globals()[name]
    raise AttributeError(name)
