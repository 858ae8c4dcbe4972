"""The cost model's figures in words: durations, what bounds a mode, and the prediction table `reshard plan`
prints. (The figures are `cost.ModeCost`s, `cost.Links` and a `cost.Prediction`; cost imports this room.)
"""
from __future__ import annotations

from reshard_cli.base.text import fmt_bytes

def fmt_seconds(x: float) -> str:
    """A duration with its unit: 143.1 s, 2.36 s, 144 ms, 35.5 us."""
    if x >= 100:
        return f"{x:.1f} s"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms" if x < 0.1 else f"{x * 1e3:.0f} ms"
    if x > 0:
        return f"{x * 1e6:.3g} us"
    return "0"


def bound_by(mc, lk) -> str:
    """The largest term of the sequential figure of `mc` (a `cost.ModeCost`) under links `lk`, in words."""
    terms = []
    phase0 = max(mc.network_s, mc.nvlink0_s)
    if phase0:
        if mc.network_s >= mc.nvlink0_s:
            r, nb, m = mc.busiest["network"]
            terms.append((mc.network_s, f"network: rank {r} moves {fmt_bytes(nb)} in {m} messages"))
        else:
            r, nb, m = mc.busiest["nvlink_phase0"]
            terms.append((mc.nvlink0_s, f"NVLink phase 0: rank {r} moves {fmt_bytes(nb)}"))
    if mc.forward_s:
        r, nb, m = mc.busiest["forward"]
        terms.append((mc.forward_s, f"NVLink forwards: rank {r} moves {fmt_bytes(nb)}"))
    if mc.ring_s:
        bw = mc.ring_s - mc.ring_latency_s
        if mc.ring_latency_s > bw:
            terms.append((mc.ring_s, f"broadcast ring latency: {mc.packs} packs x {mc.ring_hops} hops x "
                                     f"{lk.latency_us:g} us"))
        else:
            terms.append((mc.ring_s, f"broadcast rings: {mc.packs} packs through {mc.ring_gbps:g} GB/s rings"))
    if mc.gather_s:
        terms.append((mc.gather_s, "gathers on the broadcast roots"))
    if not terms:
        return "nothing to move"
    return max(terms, key=lambda x: x[0])[1]


def prediction_text(pred) -> str:
    rows = []
    lb = pred.bound.seconds
    for m, c in pred.modes.items():
        rows.append([m, fmt_seconds(c.seconds), fmt_seconds(c.pipelined_seconds), fmt_seconds(c.network_s),
                     fmt_seconds(c.nvlink0_s + c.forward_s), fmt_seconds(c.gather_s + c.ring_s),
                     f"{c.seconds / lb:.2f}x" if lb else "-", c.bound_by])
    lines = [
        f"  predicted     {pred.topology} links: {pred.links.describe()}  (predicted in "
        f"{pred.seconds * 1e3:.0f} ms)",
        _table(["mode", "time", "pipelined", "network", "in-domain", "broadcast", "vs bound", "bound by"], rows),
        "  (time: forwards after the network phase and the broadcast path after the reshard path, an upper",
        "   bound; pipelined: forwards overlapped with the network phase, as the transport forwards each",
        "   bucket as it lands, and gathers with broadcasts)",
        f"  lower bound   {fmt_seconds(lb)}  {pred.bound.resource}"
        f"  (ingress {fmt_seconds(pred.bound.ingress_s)}, egress {fmt_seconds(pred.bound.egress_s)})",
    ]
    this = pred.modes.get(pred.plan_mode)
    if this is not None:
        ratio = f" = {this.seconds / lb:.2f}x the lower bound" if lb else ""
        lines.append(f"  this plan     {pred.plan_mode}: {fmt_seconds(this.seconds)} predicted{ratio}, bound by "
                     f"{this.bound_by}")
    return "\n".join(lines)


def _table(headers: list, rows: list) -> str:
    """Like report.table (first column left, the rest right-aligned), but the last column (a phrase) left."""
    cells = [headers] + rows
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(headers))]
    out = []
    for j, r in enumerate(cells):
        parts = [str(r[0]).ljust(widths[0])] + [str(c).rjust(w) for c, w in zip(r[1:-1], widths[1:-1])] + [str(r[-1])]
        out.append("  " + ("# " if j == 0 else "  ") + "  ".join(parts).rstrip())
    return "\n".join(out)


__all__ = ["bound_by", "fmt_seconds", "prediction_text"]
