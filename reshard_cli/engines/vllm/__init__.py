"""reshard inside vLLM: the `reshard` weight-transfer backend (worker and trainer engines) and `reshard run`
pushing into a running `vllm serve`.

Installing reshard registers the backend through the `vllm.general_plugins` entry point (`plugin`), so
`LLM(..., weight_transfer_config={"backend": "reshard"})` and `vllm serve ... --weight-transfer-config
'{"backend": "reshard"}'` build `ReshardWorkerEngine` in each worker. Trainer side (every trainer rank, after
its own `init_process_group`):

    engine = WeightTransferTrainerFactory.trainer_init(
        ReshardTrainerInitInfo(host=..., port=..., dst=open("infer.yaml").read(), rank=rank),
        client=LLMClient(llm),  # or vLLM's HTTPVLLMWeightSyncClient(url); None on ranks other than 0
        source=ReshardSource(lambda: dict(model.named_parameters())))
    report = engine.send_weights()          # after each optimizer step

Every trainer rank and every vLLM worker meet in a refit group of their own (`transfer.comm.refit_group`: gloo
on CPU, NCCL on GPUs; never vLLM's process group). What is not vLLM's (the handshake, a fleet's replicas and
members) is in `engines.fleet`, shared with any other engine.

Modules:
  compat       every touchpoint with vLLM's internals, and the vLLM versions checked
  plugin       the entry point: registers both engines in vLLM's factories
  info         the init / update info dataclasses
  worker       the worker engine (inside vLLM), over `target.EngineTarget` (where the bytes land)
  saved        what vLLM's processing of a module may replace, saved so an abort restores it exactly
  trainer      the trainer engine and its weight source (the fleet's logic: `engines.fleet.members`)
  cpu_repairs  repairs of vLLM 0.32's update path (docs/upstream/ has each defect's reproduction)
  full         the full-tensor baseline (`path: full`)
  clients      the control plane's clients, a fleet member (`VLLMMember`), `check_engine`, `portable_layout`
  push         `reshard run` into a running `vllm serve`

The names below are importable from this package; the vLLM-dependent ones import their module (and vLLM) on
first use, so importing the package needs no vLLM.
"""
from __future__ import annotations

import importlib

_NAMES = {"register": "plugin", "BACKEND": "plugin", "LLMClient": "clients", "http_client": "clients",
          "check_engine": "clients", "portable_layout": "clients",
          "ReshardInitInfo": "info", "ReshardUpdateInfo": "info", "ReshardTrainerInitInfo": "info",
          "ReshardWorkerEngine": "worker", "ReshardSource": "trainer", "ReshardTrainerEngine": "trainer"}


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
