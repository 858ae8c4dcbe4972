"""What `reshard plan` prints and writes: the plan text and the streamed piece list (`--pieces`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from reshard_cli.errors import ConfigError
from reshard_cli.base.files import atomic_write
from reshard_cli.base.text import fmt_bytes, fmt_count, pct, table


def plan_text(s: dict) -> str:
    """What `reshard plan` prints."""
    lines = [
        f"reshard plan: {s['model']}  {s['src']} ({s['src_ranks']} ranks) -> {s['dst']} ({s['dst_ranks']} ranks)"
        f"  mode {s['mode']}  topology {s['topology']}",
        f"  model         {fmt_count(s['params'])} params in {s['tensors']} tensors, {fmt_bytes(s['bytes'])}",
        f"  paths         reshard {fmt_bytes(s['paths']['reshard'])} ({pct(s['paths']['reshard'], s['bytes'])}), "
        f"broadcast {fmt_bytes(s['paths']['broadcast'])} ({pct(s['paths']['broadcast'], s['bytes'])})",
        *_route_lines(s),
        f"  network wire  {fmt_bytes(s['wire_bytes'])}   minimum {fmt_bytes(s['min_wire_bytes'])}"
        f" ({_ratio(s['wire_bytes'], s['min_wire_bytes'])} of it)   gather->broadcast "
        f"{fmt_bytes(s['broadcast_wire_bytes'])} ({_ratio(s['broadcast_wire_bytes'], s['wire_bytes'])} of this plan)",
        *_on_wire_lines(s),
        f"  in-domain     {fmt_bytes(s['indomain_bytes'])} (forwarded between destination ranks "
        f"{fmt_bytes(s['forwarded_bytes'])})",
        f"  pieces        {s['pieces']} ({s['classes']} tensor classes planned once each)",
        f"  busiest rank  send {fmt_bytes(s['max_rank_send_bytes'])} (ideal {fmt_bytes(s['ideal_rank_send_bytes'])}, "
        f"{_over(s['max_rank_send_bytes'], s['ideal_rank_send_bytes'])}), recv {fmt_bytes(s['max_rank_recv_bytes'])} "
        f"(ideal {fmt_bytes(s['ideal_rank_recv_bytes'])}, {_over(s['max_rank_recv_bytes'], s['ideal_rank_recv_bytes'])})",
        f"  planned in    {s['plan_seconds'] * 1e3:.0f} ms",
        *_storage_lines(s.get("trainer"), s.get("engine"), s.get("staging")),
        *_fleet_lines(s.get("fleet")),
        *_fp8_lines(s.get("fp8")),
        *(f"  not refit     {line}" for line in s.get("not_refit", ())),
        "",
        table(["path", "tensors", "bytes", "wire", "in-domain", "pieces"],
              [[p, v["tensors"], fmt_bytes(v["bytes"]), fmt_bytes(v["wire_bytes"]), fmt_bytes(v["indomain_bytes"]),
                v["pieces"]] for p, v in s["path_stats"].items()]),
    ]
    return "\n".join(lines)


def _on_wire_lines(s: dict) -> list[str]:
    """Into a block-FP8 engine (`plan.fp8.on_wire`): what the figures above and below weigh."""
    if "bf16_wire_bytes" not in s:
        return []
    return [f"                bytes as they travel: FP8 and scales where the senders quantize, BF16 elsewhere "
            f"(the same pieces all in BF16 {fmt_bytes(s['bf16_wire_bytes'])}, minimum "
            f"{fmt_bytes(s['bf16_min_wire_bytes'])}); gather->broadcast sends BF16 full tensors, the engine quantizes"]


def _fp8_lines(f: dict | None) -> list[str]:
    """An FP8 engine (`plan.fp8`): where its blocks are quantized, and the wire beside a BF16 refit's."""
    if not f:
        return []
    lines = [f"  fp8 engine    {f['scheme']}: {f['quantized_tensors']} tensors quantized "
             f"({fmt_count(f['quantized_params'])} params, scales {fmt_bytes(f['scale_bytes'])}), "
             f"{pct(f['sender_share'], 1)} of them on the sender",
             f"  fp8 wire      {fmt_bytes(f['wire_bytes'])} = {fmt_bytes(f['sender_quantized_bytes'])} FP8 quantized by "
             f"the senders + {fmt_bytes(f['receiver_quantized_bytes'])} BF16 quantized by the workers + "
             f"{fmt_bytes(f['unquantized_bytes'])} unquantized; {f['wire_ratio']:.2f}x the same pieces in BF16 "
             f"({fmt_bytes(f['bf16_wire_bytes'])})"]
    cut = [(k, v) for k, v in f["by_kind"].items() if v["sender_share"] < 1]
    if cut:
        lines.append("  fp8 receiver  " + ", ".join(f"{k} ({pct(1 - v['sender_share'], 1)} of it)" for k, v in cut[:4])
                     + (f" and {len(cut) - 4} more kinds" if len(cut) > 4 else ""))
    return lines


def _route_lines(s: dict) -> list[str]:
    """Mode auto: which route each class of tensors took (forward / direct: the reshard path), and why."""
    routes = s.get("routes")
    if not routes:
        return []
    parts = []
    for r, v in routes.items():
        if v["tensors"]:
            parts.append(f"{r} {fmt_bytes(v['bytes'])} ({pct(v['bytes'], s['bytes'])}, {v['tensors']} tensors in "
                         f"{v['classes']} class{'es' if v['classes'] != 1 else ''})")
    return [f"  auto routes   {', '.join(parts) or 'nothing to move'}",
            f"                {s.get('routes_by', '')}".rstrip()]


def _storage_lines(trainer: dict | None, engine: dict | None, stage: dict | None = None) -> list[str]:
    """Where a framework format keeps the bytes (`formats.summary`): the trainer's storage, read in place, and
    one engine rank's storage, written in place; what an update stages per worker (`plan.groups.staging`)."""
    lines = []
    if trainer:
        t = trainer
        lines.append(f"  trainer       {t['format']} storage on rank {t['rank']}: {t['megatron_tensors']} parameters "
                     f"({t['fused_tensors']} fused from several checkpoint tensors), {fmt_bytes(t['megatron_bytes'])}; "
                     f"sent bytes are read in place: {fmt_bytes(t['direct_bytes'])} "
                     f"({pct(t['direct_bytes'], t['megatron_bytes'])} of it; the rest is vocab padding)")
    if engine:
        e = engine
        lines.append(f"  engine        {e['format']} storage on rank {e['rank']}: {e['engine_tensors']} tensors "
                     f"({e['fused_tensors']} fused or stacked), {fmt_bytes(e['engine_bytes'])}; received bytes land in "
                     f"place: {fmt_bytes(e['direct_bytes'])} of {fmt_bytes(e['checkpoint_bytes'])} "
                     f"({pct(e['direct_bytes'], e['checkpoint_bytes'])}), padding {fmt_bytes(e['padding_bytes'])} "
                     f"untouched")
        if e.get("derived"):
            lines.append("                placed as vLLM's own loaders place it (a storage map derived from them)")
        if e.get("staged_bytes"):
            lines.append(f"                staged, then written as vLLM's loader writes them (several regions, a "
                         f"transform or a cast): {fmt_bytes(e['staged_bytes'])} in {e['staged_tensors']} tensors")
    if stage:
        lines.append(f"  staging       {stage['stage_mb']:g} MiB per worker: {stage['groups']} group(s) of whole "
                     f"layers, at most {fmt_bytes(stage['peak_bytes'])} in checkpoint format at once, against "
                     f"{fmt_bytes(stage['whole_bytes'])} for the whole model (largest layer "
                     f"{fmt_bytes(stage['largest_layer_bytes'])})")
    return lines


def _fleet_lines(f: dict | None) -> list[str]:
    """A destination of several replicas (`plan.fleet`): this one refit beside one refit per replica."""
    if not f:
        return []
    return [f"  fleet         {f['replicas']} replicas x {f['workers_per_replica']} ranks: one refit of all sends "
            f"{fmt_bytes(f['wire_bytes'])} on the wire; one refit per replica {fmt_bytes(f['separate_refits_wire_bytes'])}"
            f" ({_ratio(f['separate_refits_wire_bytes'], f['wire_bytes'])}), gather->broadcast "
            f"{fmt_bytes(f['broadcast_wire_bytes'])}", *_loss_lines(f.get("loss"))]


def _loss_lines(loss: dict | None) -> list[str]:
    """`reshard plan --replicas N` (`plan.fleet.loss_figures`): what the survivors are sent when one replica is
    lost mid-refit, in the first staging group and in the last."""
    if not loss:
        return []
    n, g = loss["replicas_after"], loss["groups"]
    if g <= 1:
        when = f"re-sends {fmt_bytes(loss['resent_bytes_first_group'])} to the {n} survivors (one staging group: " \
               f"the whole refit again)"
    else:
        when = f"re-sends {fmt_bytes(loss['resent_bytes_first_group'])} to the {n} survivors (lost in group 1 of " \
               f"{g}) .. {fmt_bytes(loss['resent_bytes_last_group'])} (lost in the last), mean " \
               f"{fmt_bytes(loss['resent_bytes_mean'])}; resumed at the failed group's first layer" + \
               (f" in the survivors' own {loss['survivor_groups']} groups" if loss["survivor_groups"] != g else "") + \
               "; committed layers are not sent again"
    return [f"  losing one    replica mid-refit: the trainer {when}"]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _over(actual: float, ideal: float) -> str:
    return f"{100.0 * (actual - ideal) / ideal:+.1f} %" if ideal else "-"


PIECES_FORMAT = "reshard-pieces/1"


def write_pieces(path: str | Path, plan, pieces: Iterable, bcasts: Iterable) -> int:
    """Stream a plan's pieces to `path` as JSON Lines (gzip when it ends in .gz); returns the line count.

    Line 1 is a header: format, layouts, mode, the tensor names (pieces refer to them by index) and the
    destination group every broadcast goes to. Then one compact array per line, so the file can be read
    in a stream at 10^8 pieces:
        ["p", tensor, src, dst, phase, [offsets], [sizes]]             a reshard-path piece
        ["b", tensor, root, [[src, [offsets], [sizes]], ...]]          a gather -> broadcast
    """
    import gzip

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    header = {"format": PIECES_FORMAT, "src": plan.src.name, "dst": plan.dst.name, "mode": plan.mode,
              "topology": plan.topology.describe(), "tensors": [t.name for t in plan.src.manifest.tensors],
              "broadcast_receivers": list(plan.dst.ranks)}
    n = 1

    def write(tmp: str) -> None:
        nonlocal n
        with opener(tmp, "wt") as f:
            f.write(json.dumps(header) + "\n")
            dumps = json.JSONEncoder(separators=(",", ":")).encode
            for pc in pieces:
                f.write(dumps(["p", pc.tensor, pc.src, pc.dst, pc.phase, pc.box.offsets, pc.box.sizes]) + "\n")
                n += 1
            for b in bcasts:
                f.write(dumps(["b", b.tensor, b.root, [[s, a.offsets, a.sizes] for s, a in b.gather]]) + "\n")
                n += 1

    try:
        atomic_write(path, write)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}", key="--pieces") from None
    return n
