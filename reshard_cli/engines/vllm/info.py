"""The `reshard` backend's init and update info: what vLLM parses from the init / update calls' dicts (worker
side), and what the trainer passes to `WeightTransferTrainerFactory.trainer_init`. Importing it needs vLLM, and
registers the backend in this process: a trainer process never runs vLLM's plugin loader, and without the
registration `trainer_init(ReshardTrainerInitInfo(...))` would answer "Invalid weight transfer backend"."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from reshard_cli.engines.fleet.members import checked_fleet_settings
from reshard_cli.engines.vllm import compat, plugin
from reshard_cli.errors import ConfigError
from reshard_cli.formats.base import checked_stage_mb
from reshard_cli.plan.terms import MODES
from reshard_cli.transfer.shm import checked_transport

BACKEND = plugin.BACKEND
_api = compat.transfer_api()
PATHS = ("reshard", "full")


def _validated(info) -> None:
    """The one check of an init info's settings, on the side that builds it (the trainer, before any engine is
    called; a worker, before it joins the group): anything a user can get wrong refused in one line naming it."""
    if info.path not in PATHS:
        raise ConfigError(f"must be one of {', '.join(PATHS)}, not {info.path!r}", key="path")
    if info.mode not in MODES:
        raise ConfigError(f"must be one of {', '.join(MODES)}, not {info.mode!r}", key="mode")
    checked_transport(info.transport, key="transport")
    checked_stage_mb(info.stage_mb)
    for key, low in (("timeout", 0.0), ("bucket_mb", 0.0), ("stall", None)):
        value = getattr(info, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                (value <= low if low is not None else value < 0):
            raise ConfigError(f"must be a number {'>' if low is not None else '>='} 0, not {value!r}", key=key)


@dataclass
class ReshardInitInfo(_api.WeightTransferInitInfo):
    host: str
    port: int
    world_size: int  # trainer ranks + the engine's workers, the ranks the layouts name
    dst: str  # the engine's layout, YAML text, `format: vllm`; its i-th rank is vLLM worker i
    src: str = ""  # the trainer's layout, YAML text; empty: read from the trainer's DTensors
    trainer_size: int = 0  # with no src: the trainer's ranks (the engine's ranks follow them)
    timeout: float = 300.0
    bucket_mb: float = 64.0
    path: str = "reshard"  # or "full": the baseline (full tensors to every worker, then load_weights)
    stage_mb: float | None = None  # checkpoint-format MiB a worker stages at once (whole layers; 0: the whole
    # model); None: the layout's `engine: {stage_mb}`, else plan.groups.DEFAULT_STAGE_MB
    replica: int = 0  # the layout's replica (its `dp` coordinate) of this engine's first data-parallel rank: a
    # fleet of several engines gives each its own; worker w of DP rank d is layout rank (replica + d) × TP×PP + w
    topology: str = ""  # the refit ranks' NVLink domains: "" none, "auto" (NVML on every rank), a bundled name,
    # or a topology file's YAML text (`handshake.refit_topology`)
    mode: str = "auto"  # the plan's mode (`reshard plan --mode`): auto picks each tensor class's route
    stall: float = 0.0  # seconds without a peer's heartbeat before it is named as stalled (0: the default, 10 s
    # or half the timeout); the update returns, and the engine serves again, as soon as it is named
    transport: str = "auto"  # what carries the refit's messages: "auto" (the group's backend) or "shm" (shared
    # memory between the ranks of one host: a trainer colocated with the engine; `transfer.shm`)

    def __post_init__(self):  # vLLM's worker surfaces a ValueError from parsing its init info
        try:
            _validated(self)
        except ConfigError as e:
            raise ValueError(f"reshard: {e}") from None


@dataclass
class ReshardUpdateInfo(_api.WeightTransferUpdateInfo):
    verify: bool = True
    resume_layer: int | None = None  # the engine already holds the tensors outside the decoder layers and the
    # layers below this one: the trainer's fleet after a dropped member, whose survivors committed them in the
    # failed attempt; the refit starts at the first group holding a later layer (`Refit.__call__`)


@dataclass
class ReshardTrainerInitInfo(_api.TrainerInitInfo):
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
    stage_mb: float | None = None  # what each worker stages at once (ReshardInitInfo.stage_mb)
    topology: str = ""  # ReshardInitInfo.topology: the refit ranks' domains (trainer ranks first)
    mode: str = "auto"  # ReshardInitInfo.mode
    stall: float = 0.0  # ReshardInitInfo.stall
    transport: str = "auto"  # ReshardInitInfo.transport
    on_member_fault: str = "drop"  # a fleet member whose engine fails, dies or stalls during an update: "drop"
    # it and run the update again among the others (a new group and plan), or "fail" the update
    on_partial: str = "pause"  # an update that failed after committing some groups leaves the engine on a mix
    # of two steps: "pause" pauses its generation (vLLM's pause route) until a complete refit lands; "serve"
    # keeps serving it (its weight version says what it holds)

    def __post_init__(self):
        _validated(self)
        checked_fleet_settings(self)


plugin.register()  # importing the trainer API is enough to use it (see the module docstring)
