"""What `reshard bench` shows: ratios between modes, the nccl-tests-style tables, the report text, --json and
the --plot PNG. Formatting only: the figures come from `measure` and `plan_scaling`."""
from __future__ import annotations

import sys
from pathlib import Path

from reshard_cli.bench.suite import SHM, BenchOptions, base_mode, modes_of
from reshard_cli.errors import ConfigError, RuntimeFailure
from reshard_cli.base.text import fmt_bytes, table, write_json


def say(msg: str) -> None:
    """A progress line on stderr."""
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def add_ratios(case: dict) -> dict:
    """Per mode: speed-up over broadcast and over DCP (their time / this time) and the fraction of the link
    limit (this GB/s / link GB/s, both in model bytes). None where a time is missing."""
    modes = case["modes"]

    def over(other: str, m: str):
        a, b = modes.get(other, {}).get("seconds"), modes[m].get("seconds")
        return a / b if a and b else None

    link = case.get("link_limit_gbps")
    for m, v in modes.items():
        v["vs_broadcast"] = over("broadcast", m)
        v["vs_dcp"] = over("dcp", m)
        v["of_link"] = v["gbps"] / link if link and v.get("gbps") else None
        if m.endswith(SHM):  # over shared memory: the same mode over the backend's time / this time
            v["vs_backend"] = over(base_mode(m), m)
            copy = case.get("copy_limit_gbps")
            v["of_copy"] = v["gbps"] / copy if copy and v.get("gbps") else None
    return case


def ordered(modes) -> list[str]:
    """The modes of `modes` (names) in the report's order: MODES, each twin over shared memory beside it."""
    return [m for m in modes_of("shm") if m in modes]


def _x(r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else "-"


def _pct(r: float | None) -> str:
    return f"{100 * r:.0f} %" if r is not None else "-"


def case_table(case: dict) -> str:
    """One case, nccl-tests style: a header line, then link limit and every mode."""
    head = (f"{case['name']}: {case['model']} {fmt_bytes(case['bytes'])} in {case['tensors']} tensors  "
            f"{case['src']} ({case['src_ranks']} ranks) -> {case['dst']} ({case['dst_ranks']} ranks)  "
            f"bucket {fmt_bytes(case['bucket_bytes'])}")
    rows = [["link limit", ms(case["link_limit_seconds"]), _cpu(case.get("link_limit_cpu_seconds")),
             f"{case['link_limit_gbps']:.2f}", fmt_bytes(case["link_bytes"]), "-", "-", "-", "-", "100 %"]]
    if case.get("copy_limit_seconds"):
        rows.append(["copy limit", ms(case["copy_limit_seconds"]), "-", f"{case['copy_limit_gbps']:.2f}", "-", "-",
                     "-", "-", "-", _pct(case["copy_limit_gbps"] / case["link_limit_gbps"])
                     if case.get("link_limit_gbps") else "-"])
    for m in ordered(case["modes"]):
        v = case["modes"][m]
        rows.append([m, ms(v["seconds"]), _cpu(v.get("cpu_seconds")), f"{v['gbps']:.2f}", fmt_bytes(v["wire_bytes"]),
                     fmt_bytes(v["peak_staging_bytes"]) + ("*" if m == "dcp" else ""), v["wrong"],
                     _x(v.get("vs_broadcast")), _x(v.get("vs_dcp")), _pct(v.get("of_link"))])
    return "\n".join([f"  {head}", table(["mode", "time ms", "CPU ms", "GB/s", "wire", "staging", "#wrong",
                                          "vs bcast", "vs dcp", "of link"], rows, indent="    ")])


def _cpu(seconds: float | None) -> str:
    return ms(seconds) if seconds is not None else "-"  # a JSON written by an earlier version has none


def present(items: list[dict]) -> list[str]:
    """The modes every case or sweep point has, in the report's order (a JSON written by another version may lack
    some)."""
    return [m for m in ordered(items[0]["modes"]) if all(m in x["modes"] for x in items)] if items else []


def sweep_table(points: list[dict]) -> str:
    modes = present(points)
    rows = []
    for p in points:
        row = [f"x{p['scale']}", fmt_bytes(p["bytes"]), f"{ms(p['link_limit_seconds'])} / {p['link_limit_gbps']:.2f}"]
        row += [f"{ms(p['modes'][m]['seconds'])} / {p['modes'][m]['gbps']:.2f}" for m in modes]
        rows.append(row)
    return table(["scale", "bytes", "link ms / GB/s"] + [f"{m} ms / GB/s" for m in modes], rows, indent="    ")


def plan_table(rows: list[dict]) -> str:
    return table(["pair", "ranks", "tensors", "classes", "pieces", "load s", "stats s", "us/piece", "us/tensor"],
                 [[r["name"], f"{r['src_ranks']}->{r['dst_ranks']}", r["tensors"], r["classes"], r["pieces"],
                   f"{r['load_seconds']:.2f}", f"{r['seconds']:.2f}", f"{1e6 * r['seconds'] / max(r['pieces'], 1):.3f}",
                   f"{1e6 * r['seconds'] / max(r['tensors'], 1):.1f}"] for r in rows], indent="    ")


def report_text(doc: dict) -> str:
    lines = [f"reshard bench: suite {doc['suite']}  backend {doc['backend']}"
             f"{'  transports ' + ' + '.join(doc['transports']) if len(doc.get('transports', ())) > 1 else ''}"
             f"  device {doc['device']}  "
             f"world {doc['world']}  iters {doc['iters']} (median after 1 warm-up; each run between barriers, "
             f"slowest rank)"]
    for case in doc["cases"]:
        lines += ["", case_table(case)]
    dcp_kinds = {c["modes"]["dcp"].get("staging_kind") for c in doc["cases"]}
    lines += ["",
              "  GB/s: model bytes / time (link limit too: the reshard plan's traffic per sender->receiver pair as raw "
              "concurrent isend/irecv). vs bcast / vs dcp: their time / this time. of link: this GB/s / link GB/s.",
              "  wire: plan network bytes (dcp: bytes written + read). staging: Engine.peak_staging_bytes per rank; "
              f"* dcp: {'; '.join(sorted(k for k in dcp_kinds if k))}."]
    first = doc["cases"][0] if doc["cases"] else {"modes": {}}
    shm = [m for m in ordered(first["modes"]) if m.endswith(SHM)]
    if shm:
        lines.append("  @shm: the same mode over shared memory between the ranks of this host (--transport shm); copy "
                     "limit: every rank copies the bytes it sends and receives once each, all at once. Over shared "
                     f"memory vs the backend ({first['name']}: its time / this time): "
                     + ", ".join(f"{m} {_x(first['modes'][m].get('vs_backend'))}" for m in shm) + ".")
    cores = {c.get("cores") for c in doc["cases"]} - {None}
    if cores:
        lines.append(f"  CPU ms: CPU time of every process of the job per run (all threads, user + sys; median): on "
                     f"the {'/'.join(map(str, sorted(cores)))} cores they share, a run cannot take less than CPU ms / "
                     f"{'/'.join(map(str, sorted(cores)))}.")
    if doc.get("sweep"):
        lines += ["", f"  size sweep: {doc['sweep'][0]['case']} at --scale {','.join(str(p['scale']) for p in doc['sweep'])}",
                  sweep_table(doc["sweep"])]
        lines.append("  " + _growth_text(doc["sweep"]))
    if doc.get("plan_scaling"):
        lines += ["", "  plan scaling: Plan(src, dst, mode=reshard).stats() on rank 0 after the job "
                      "(fresh Plan, no topology)", plan_table(doc["plan_scaling"])]
    return "\n".join(lines)


def _growth_text(points: list[dict]) -> str:
    """How time grows with bytes from the smallest to the largest sweep point, per mode."""
    if len(points) < 2:
        return "growth: one size only"
    a, b = points[0], points[-1]
    k = b["bytes"] / a["bytes"] if a["bytes"] else 0
    parts = []
    for m in present(points):
        ta, tb = a["modes"][m]["seconds"], b["modes"][m]["seconds"]
        parts.append(f"{m} {tb / ta:.1f}x" if ta else f"{m} -")
    return f"time growth for {k:.1f}x the bytes: " + ", ".join(parts)


# ----------------------------------------------------------------------------------------------- plot


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("needs matplotlib: pip install 'reshard[plot]' (or pip install matplotlib)",
                          key="--plot") from None
    return plt


def write_plot(doc: dict, path: Path) -> None:
    """Time and GB/s per mode for every case, and the size sweep (time vs bytes)."""
    plt = _pyplot()
    cases = doc["cases"]
    panels = 3 if doc.get("sweep") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    modes = present(cases)
    width = 0.8 / len(modes)
    xs = range(len(cases))
    for j, m in enumerate(modes):
        off = [x - 0.4 + width * (j + 0.5) for x in xs]
        axes[0].bar(off, [c["modes"][m]["seconds"] * 1e3 for c in cases], width, label=m)
        axes[1].bar(off, [c["modes"][m]["gbps"] for c in cases], width, label=m)
    axes[1].scatter(list(xs), [c["link_limit_gbps"] for c in cases], marker="_", s=600, color="k", zorder=3,
                    label="link limit")
    for ax, ylabel in ((axes[0], "time (ms, median)"), (axes[1], "GB/s (model bytes)")):
        ax.set_xticks(list(xs))
        ax.set_xticklabels([c["name"] for c in cases], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    if panels == 3:
        pts = doc["sweep"]
        ax = axes[2]
        by = [p["bytes"] / 1e6 for p in pts]
        ax.plot(by, [p["link_limit_seconds"] * 1e3 for p in pts], "k--", label="link limit")
        for m in present(pts):
            ax.plot(by, [p["modes"][m]["seconds"] * 1e3 for p in pts], "o-", label=m)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("model MB")
        ax.set_ylabel("time (ms, median)")
        ax.set_title(f"size sweep: {pts[0]['case']}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"reshard bench: {doc['suite']} ({doc['backend']}, world {doc['world']}, iters {doc['iters']})")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}", key="--plot") from None
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------------------------ output


def check_outputs(opts: BenchOptions) -> None:
    """Before the job: --json / --plot can be written (and matplotlib is there), not after the whole run."""
    if opts.plot is not None:
        _pyplot()
    for flag, p in (("--json", opts.json), ("--plot", opts.plot)):
        if p is not None and not Path(p).resolve().parent.is_dir():
            raise ConfigError(f"cannot write {p}: no such directory", key=flag)


def finish(doc: dict, opts: BenchOptions) -> None:
    """The report on stdout, --json and --plot; then RuntimeFailure (exit 1) if a mode was wrong."""
    print(report_text(doc), flush=True)
    if opts.json is not None:
        try:
            write_json(opts.json, doc)
        except OSError as e:
            raise ConfigError(f"cannot write {opts.json}: {e.strerror or e}", key="--json") from None
        print(f"  wrote {opts.json}")
    if opts.plot is not None:
        write_plot(doc, opts.plot)
        print(f"  wrote {opts.plot}")
    bad = [(c["name"], m) for c in doc["cases"] for m, v in c["modes"].items() if v["wrong"]]
    bad += [(f"sweep x{p['scale']}", m) for p in doc["sweep"] for m, v in p["modes"].items() if v["wrong"]]
    if bad:
        raise RuntimeFailure("verification failed: " + ", ".join(f"{c} {m}" for c, m in bad[:6])
                             + (" ..." if len(bad) > 6 else ""))
