"""reshard: refit LLM weights between parallel layouts as a DTensor→DTensor redistribution.

The package follows the data, one direction, no back and forth:

    spec/      what the user writes: layout YAML, model manifests, topologies, the bundled data
    plan/      pure planning, no torch.distributed: DTensor-exact geometry, the plan (pieces and broadcasts),
               the message schedule, the cost model
    transfer/  executing a plan: the engine, verification, the torchrun launcher, `reshard run`'s worker,
               the live `Refit` API
    io/        where bytes come from and go to: sources (synthetic, safetensors, shards, DCP), sinks, `check`
    hw/        the machine: NVML discovery, bandwidth probes
    bench/     `reshard bench`: every way to refit, side by side
    cli.py     the thin Typer commands; report.py the tables and JSON

The public entry points are importable from here: `load_pair`, `load_layout`, `load_topology`, `Plan`,
`Refit`, `check_output`, `open_source`. Those that need torch are imported on first use, so planning stays
fast and torch-free.
"""

__version__ = "0.1.0"

_LAZY = {
    "load_pair": "reshard_cli.formats",
    "load_layout": "reshard_cli.formats",
    "load_topology": "reshard_cli.layouts.topology",
    "Plan": "reshard_cli.plan.planner",
    "TransferOptions": "reshard_cli.plan.schedule",
    "Refit": "reshard_cli.transfer.live",
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
