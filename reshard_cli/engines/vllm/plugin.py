"""vLLM's `vllm.general_plugins` entry point: pyproject.toml declares `reshard =
"reshard_cli.engines.vllm.plugin:register"`, so every vLLM process (the engine core and its workers) registers
the backend `reshard` in vLLM's two factories. Importing it needs no vLLM; the engines' modules are imported
by the factories on first use."""
from __future__ import annotations

from reshard_cli.engines.vllm import compat

BACKEND = "reshard"
ENGINE = "vLLM"  # what the refit group's lines call the engine's ranks ("vLLM worker 1")


def register() -> None:
    """Register both engines (idempotent; vLLM may call it more than once)."""
    compat.register(BACKEND, worker=("reshard_cli.engines.vllm.worker", "ReshardWorkerEngine"),
                    trainer=("reshard_cli.engines.vllm.trainer", "ReshardTrainerEngine"))
