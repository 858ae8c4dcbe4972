"""reshard: refit LLM weights between parallel layouts as a DTensor→DTensor redistribution.

The package is layered, bottom to top, imports running down only (ARCHITECTURE.md; tests/test_architecture.py
enforces it):

    base/      helpers every layer uses: box geometry, checksums, fragments, atomic files, ports, tables
    layouts/   what the user writes: layout YAML, model manifests, topologies, the bundled data
    formats/   how a framework stores a checkpoint (hf, megatron, vllm), and layouts loaded through them
    plan/      pure planning, no torch.distributed: the plan (pieces and broadcasts), the message schedule,
               the cost model (which also chooses auto's routes)
    hw/        the machine: NVML discovery, bandwidth probes
    io/        where bytes come from and go to: sources (synthetic, safetensors, shards, DCP), sinks, `check`
    transfer/  executing a plan: the engine, verification, the torchrun launcher, `reshard run`'s worker,
               the live `Refit` API
    engines/   inference engines, each in a room of its own (vLLM's weight-transfer backend)
    bench/     `reshard bench`: every way to refit, side by side
    cli.py     the thin Typer commands; report.py the plan text and the piece list

The public entry points are importable from here: `load_pair`, `load_layout`, `load_topology`, `Plan` (in mode
auto, `with_auto_routes(plan)` gives it the cost model's route per tensor class), `Refit` (with `RefitFailed`
and `Stage`, for refits in agreed groups), `check_output`, `open_source`. Those that need torch are imported
on first use, so planning stays fast and torch-free.
"""

__version__ = "0.1.0"

_LAZY = {
    "load_pair": "reshard_cli.formats",
    "load_layout": "reshard_cli.formats",
    "load_topology": "reshard_cli.layouts.topology",
    "Plan": "reshard_cli.plan.planner",
    "with_auto_routes": "reshard_cli.plan.cost",
    "TransferOptions": "reshard_cli.plan.schedule",
    "Refit": "reshard_cli.transfer.live",
    "RefitFailed": "reshard_cli.transfer.live",
    "Stage": "reshard_cli.transfer.live",
    "check_output": "reshard_cli.io.check",
    "open_source": "reshard_cli.io.sources",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard_cli' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
