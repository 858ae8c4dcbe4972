"""`reshard bench`: every way of refitting, timed on the same processes and the same data.

One torchrun job (started here like `reshard run` does, or joined as a worker under the user's torchrun) runs
each case of a suite (or the one `--src/--dst` pair) and measures, each as the median of `--iters` timed runs
after one warm-up, every run between barriers and taken as the slowest rank:

  link limit  the reshard-mode plan's traffic (bytes per sender -> receiver pair) as raw concurrent
              isend/irecv with no packing and no phase ordering: the best this plan's traffic pattern can do
              over this backend. Its GB/s is in model bytes, like every mode's, so mode GB/s / link GB/s is
              the fraction of the best possible.
  auto        Engine over Plan(mode="auto"), the default: per class of tensors the path the cost model
              predicts cheaper
  reshard     Engine over Plan(mode="reshard")
  hybrid      Engine over Plan(mode="hybrid")
  broadcast   Engine over Plan(mode="broadcast") (gather on one trainer rank, broadcast to every inference rank)
  live        the live API: `Refit(role, src=, dst=)` called with this rank's tensors, as a trainer calls it
              after every step (mode auto; its shape checks, rebinding and barriers included)
  dcp         torch.distributed.checkpoint: save DTensors in the source layout, load DTensors in the
              destination layout, through a temporary directory (save + load timed together)

Every mode starts from destination buffers filled with the sentinel byte 0xA5 and is verified after every
run: each destination element is compared exactly with `synthetic_values` (#wrong counts wrong elements).
Staging memory: engine modes report `Engine.peak_staging_bytes`; DCP reports the peak RSS growth during
save + load, the max over ranks, or where /proc does not allow that the bytes of the local state dict.

A size sweep repeats one case at several `--scale` factors. After the job, rank 0 times planning at scale
(`Plan(...).stats()` on the bundled large layout pairs and on synthetic layouts of up to 1024 ranks per side
and 100 k tensors), then prints the report and writes --json / --plot.

    suite         options, suites and cases, the size sweep
    measure       the worker: rounds of measurements, exact expected values
    dcp           the torch.distributed.checkpoint baseline
    report        ratios, tables, report text, --json, --plot
    plan_scaling  planning at scale
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from reshard_cli.bench import measure, plan_scaling, report
from reshard_cli.bench.suite import BenchOptions, resolve, world_needed
from reshard_cli.transfer import launcher

__all__ = ["BenchOptions", "main"]


def main(opts: BenchOptions) -> None:
    """`reshard bench`: validate and launch torchrun, or be one of its workers (rank 0 reports)."""
    if not launcher.under_torchrun():
        with tempfile.TemporaryDirectory(prefix="reshard-bench-") as workdir:
            world = world_needed(resolve(opts, Path(workdir)))
        report.check_outputs(opts)
        launcher.launch(world, opts.argv)  # every worker runs this same command; rank 0 reports
        return
    doc = measure.worker(opts)
    if doc is None:  # not rank 0
        return
    doc["plan_scaling"] = plan_scaling.plan_scaling(None if opts.quiet else report.say) if opts.plan_scaling else []
    report.finish(doc, opts)
