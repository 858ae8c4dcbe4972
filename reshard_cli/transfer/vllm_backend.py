"""reshard as a vLLM weight-transfer backend (worker side), registered through vLLM's plugin entry point.

pyproject.toml declares `reshard = "reshard_cli.transfer.vllm_backend:register"` in the `vllm.general_plugins`
group, so every vLLM process (the engine core and its workers) registers the backend `reshard` in
`WeightTransferEngineFactory`; `LLM(..., weight_transfer_config={"backend": "reshard"})` then builds
`ReshardWorkerEngine` in each worker. Its life:

  init_transfer_engine  the init info names a rendezvous (host, port, world size) and both layouts (YAML text;
                        the destination `format: vllm`, one rank per vLLM worker in vLLM's rank order). The
                        worker checks the layout against vLLM's own parallel config, binds its destination
                        buffers as views into the model's parameters (`formats.vllm.bind`), and joins a refit
                        group of its own with the trainer ranks (never vLLM's process group). Any mismatch
                        fails this call with one line, before any byte moves.
  update_weights        one refit over that group (mode reshard: only the intersections move), written in
                        place into vLLM's storage; with `verify` the checksums of every shard are compared with
                        the sources' and a difference fails the call.

This is the data path for engines whose parameters stay plain after loading (vLLM's bf16 weights on GPUs).
vLLM's CPU build repacks linear weights into kernel formats after loading; `bind` then fails the init call
with a message saying so (the layerwise-reload path for such weights is not built yet).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from reshard_cli.errors import ReshardError

BACKEND = "reshard"


def register() -> None:
    """vLLM plugin entry point: register the worker engine (idempotent; vLLM may call it more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "ReshardWorkerEngine")


def _classes():
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclass
    class ReshardInitInfo(WeightTransferInitInfo):
        host: str
        port: int
        world_size: int  # trainer ranks + the engine's workers, the ranks the layouts name
        src: str  # the trainer's layout, YAML text
        dst: str  # the engine's layout, YAML text, `format: vllm`; its i-th rank is vLLM worker i
        timeout: float = 300.0
        bucket_mb: float = 64.0

    @dataclass
    class ReshardUpdateInfo(WeightTransferUpdateInfo):
        verify: bool = True

    class ReshardWorkerEngine(WeightTransferEngine):
        init_info_cls = ReshardInitInfo
        update_info_cls = ReshardUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
            import torch.distributed as dist

            from reshard_cli.formats import vllm as fmt
            from reshard_cli.spec.layout import load_pair
            from reshard_cli.transfer.comm import refit_group
            from reshard_cli.transfer.live import Refit

            try:
                with tempfile.TemporaryDirectory(prefix="reshard-vllm-") as tmp:
                    paths = []
                    for name, text in (("src.yaml", init_info.src), ("dst.yaml", init_info.dst)):
                        with open(os.path.join(tmp, name), "w") as f:
                            f.write(text)
                        paths.append(os.path.join(tmp, name))
                    src, dst = load_pair(*paths)
                worker = dist.get_rank() if dist.is_initialized() else 0
                check_deployment(dst, self.parallel_config, worker)
                self.refit_rank = dst.ranks[worker]
                self.views = fmt.bind(dict(self.model.named_parameters()), dst, self.refit_rank)
            except ReshardError as e:
                raise ValueError(f"reshard: {e}") from None
            self.group = refit_group(init_info.host, init_info.port, self.refit_rank, init_info.world_size,
                                     timeout=init_info.timeout)
            self.refit = Refit(role="dst", src=src, dst=dst, mode="reshard", bucket_mb=init_info.bucket_mb,
                               group=self.group)
            self.last_stats = None

        def start_weight_update(self) -> None:
            """Nothing to prepare: the bytes land in the parameters themselves."""

        def finish_weight_update(self) -> None:
            """Nothing to finish: every byte is in place when `update_weights` returns."""

        def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
            stats = self.refit(self.views, verify_checksums=update_info.verify)
            self.last_stats = stats
            if update_info.verify and not stats.checksums_ok:
                raise RuntimeError("reshard: checksums differ after the refit: the engine's weights are wrong")

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # CPU or GPU: the refit synchronizes

        def shutdown(self) -> None:
            self.refit = self.group = self.views = None

    return ReshardInitInfo, ReshardUpdateInfo, ReshardWorkerEngine


def check_deployment(dst, parallel_config, worker: int) -> None:
    """The destination layout must describe this vLLM deployment: format, sizes, expert parallelism."""
    from reshard_cli.errors import ConfigError

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


def __getattr__(name: str):
    """The vLLM-dependent classes are built on first use, so importing this module needs no vLLM."""
    if name in ("ReshardInitInfo", "ReshardUpdateInfo", "ReshardWorkerEngine"):
        init, update, engine = _classes()
        globals().update(ReshardInitInfo=init, ReshardUpdateInfo=update, ReshardWorkerEngine=engine)
        return globals()[name]
    raise AttributeError(name)
