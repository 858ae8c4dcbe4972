"""Refit from a real Megatron-core trainer, checked against code we did not write.

Each case starts a Megatron-core GPTModel (local layer spec: GQA, qk-layernorm, gated linear unit, MoE) on
CPU over gloo with the case's tensor / pipeline / expert parallelism, and loads known HF weights into it with
mbridge (an established Megatron<->HF converter: its own q/k/v interleaving, [gate; up] fusion, TP/ETP splits,
EP expert numbering and vocab padding). Then:

1. every parameter's place in the checkpoint, as reshard's `megatron` format derives it, is compared with
   Megatron's own `sharded_state_dict()` (sharded key, global offset, fragmentation of each local tensor);
2. the live model is refit (`Refit`, layout derived from `parallel_state` by `formats.megatron.live_layout`,
   reading Megatron's parameters in place) into 2 receiver processes holding a TP2 HF layout; their buffers
   start as a sentinel and must equal the original HF safetensors bit for bit, with checksums verified;
3. the model is saved with megatron-core's own `dist_checkpointing` (torch_dist) for the offline path
   (`reshard run --source megatron:DIR`, done by the test suite / the README).

    python examples/megatron_refit.py                        # every case
    python examples/megatron_refit.py --case moe-tp2-ep2 --json megatron.json

Needs megatron-core and mbridge (README: `pip install -e '.[megatron]'`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # vllm_refit: tiny models and engine helpers
from vllm_refit import CONFIGS as _SMALL  # noqa: E402 - examples/ is on sys.path now

# the vLLM example's tiny models, with 4 layers (2 per stage at PP2); the dense one untied, 8 heads in 4 groups
CONFIGS = {"qwen3-moe": _SMALL["qwen3-moe"] | {"num_hidden_layers": 4},
           "qwen3": _SMALL["qwen3"] | {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                                       "tie_word_embeddings": False},
           "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1000, hidden_size=128,
                         intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)}
# case: model, Megatron parallelism, number of trainer processes
CASES = {
    "qwen3-tp2": dict(model="qwen3", tp=2, pp=1, ep=1, trainers=2),
    "qwen3-pp2": dict(model="qwen3", tp=1, pp=2, ep=1, trainers=2),
    "moe-ep2": dict(model="qwen3-moe", tp=1, pp=1, ep=2, trainers=2),
    "moe-tp2-ep2": dict(model="qwen3-moe", tp=2, pp=1, ep=2, trainers=4),
    "llama-tp2-pp2": dict(model="llama", tp=2, pp=2, ep=1, trainers=4),
    # not in "all": the layout is derived for a model with other query groups than the running one
    "mismatch": dict(model="qwen3", tp=2, pp=1, ep=1, trainers=2, layout_config={"num_key_value_heads": 2}),
}
RECEIVERS = 2
VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by default
DST_LAYOUT = """model: {model}
ranks: {first}-{last}
mesh: {{tp: 2}}
placements:
  - {{match: '(q|k|v|gate|up)_proj\\.weight$|embed_tokens|lm_head', shard: {{tp: 0}}}}
  - {{match: '(o|down)_proj\\.weight$', shard: {{tp: 1}}}}
"""


def make_model(kind: str, root: str, seed: int = 0) -> str:
    import vllm_refit

    return vllm_refit.make_model(kind, root, seed=seed, config=CONFIGS[kind])


# ------------------------------------------------------------------------------------------------ Megatron


def build_megatron(hf_dir: str, tp: int, pp: int, ep: int):
    """A Megatron-core GPTModel (local spec, CPU) with the HF weights loaded by mbridge. parallel_state must be
    initialized."""
    from mbridge import AutoBridge
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    bridge = AutoBridge.from_pretrained(hf_dir)
    # CPU: no fused kernels, no grouped GEMM (that needs transformer-engine), parameters made on the CPU
    bridge.set_extra_args(use_cpu_initialization=True, moe_grouped_gemm=False, masked_softmax_fusion=False,
                          persist_layer_norm=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                          sequence_parallel=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
                          moe_token_dispatcher_type="allgather", variable_seq_lengths=False)  # alltoall: CUDA
    config = bridge.config
    hf = bridge.hf_config
    padded = -(-hf.vocab_size // (VOCAB_DIVISOR * tp)) * VOCAB_DIVISOR * tp
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(config, False),
                     vocab_size=padded, max_sequence_length=hf.max_position_embeddings,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
                     position_embedding_type="rope")  # rotary base: not a weight
    bridge.vocab_size, bridge.padded_vocab_size = hf.vocab_size, padded
    bridge.make_vocab_size_divisible_by = VOCAB_DIVISOR * tp
    _local_spec_names(bridge)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # anything mbridge does not load would show up in the comparison
        bridge.load_weights([model], hf_dir)
    return model


def _local_spec_names(bridge) -> None:
    """mbridge names parameters as the transformer-engine layer spec does (norms fused into linear layers,
    grouped-GEMM experts `linear_fc1.weightK`); this model uses the local spec (`input_layernorm`,
    `pre_mlp_layernorm`, `local_experts.K.linear_fc1`). Rename only: mbridge still does the layer and EP
    renumbering and every conversion."""
    import re

    original = bridge._weight_name_mapping_mcore_local_to_global

    def te_name(name: str) -> list[str]:
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        name = re.sub(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$", r".mlp.experts.\2.weight\1",
                      name)
        if name.endswith(".pre_mlp_layernorm.weight"):  # the MoE bridges keep this name, the dense ones fuse it
            return [name, name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")]
        return [name]

    class Renamed(torch.nn.Module):
        def __init__(self, model, names):
            super().__init__()
            self.decoder = model.decoder
            self._names = names

        def state_dict(self, *a, **k):
            return dict.fromkeys(self._names)

    def mapping(model, consider_ep: bool = True):
        real = [n for n in model.state_dict() if "_extra_state" not in n]
        out = {}
        for n in real:
            for cand in te_name(n):
                glob = original(Renamed(model, [cand]), consider_ep)[cand]
                try:
                    bridge._weight_name_mapping_mcore_to_hf(glob)
                except NotImplementedError:
                    continue
                out[n] = glob
                break
            else:
                raise RuntimeError(f"mbridge has no mapping for {n}")
        return out

    bridge._weight_name_mapping_mcore_local_to_global = mapping


def check_sharded_metadata(model, layout, rank: int) -> dict:
    import re

    """Every checkpoint view the `megatron` format gives this rank's parameters, against Megatron's own
    sharded_state_dict(): same sharded key, same global offset. Returns counts and the first mismatches."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from reshard_cli.formats import megatron as fmt

    params = dict(model.named_parameters())
    pieces: dict[str, list] = {}  # param -> [(first local row, rows, ShardedTensor)]
    sharded = model.sharded_state_dict()
    for name, st in sharded.items():
        built = st.build() if isinstance(st, ShardedTensorFactory) else st
        for s in (built if isinstance(built, list) else [built]):
            if not isinstance(s, ShardedTensor) or name not in params:
                continue
            p = params[name]
            row_bytes = (p.stride(0) if p.dim() else 1) * p.element_size()
            start = (s.data.data_ptr() - p.data_ptr()) // row_bytes
            pieces.setdefault(name, []).append((start, s.local_shape[0] if s.local_shape else 1, s))
    per_layer = any(re.match(r"decoder\.layers\.\d+\.", getattr(s, "key", "")) for s in sharded.values())
    views = fmt.global_views(layout.manifest, per_layer=per_layer)
    checked, bad = 0, []
    for et in fmt.storage(layout, rank):
        for v in et.views:
            row = v.region[0].start if v.region else 0
            where = next(((a, s) for a, n, s in pieces.get(et.name, []) if a <= row < a + n), None)
            cv = next(c for c in views[v.tensor] if v.box.intersect(c.box) == v.box)
            lead = len(cv.offsets) - len(cv.box.offsets)
            ours = (cv.key, tuple(cv.offsets[:lead]) + tuple(o + b - c for o, b, c in
                                                           zip(cv.offsets[lead:], v.box.offsets, cv.box.offsets)))
            if where is None:
                bad.append(f"{et.name}: no sharded tensor covers local row {row}")
                continue
            a, s = where
            off = list(s.global_offset)
            off[s.prepend_axis_num] += row - a
            theirs = (s.key, tuple(off))
            checked += 1
            if ours != theirs:
                bad.append(f"{et.name} row {row}: ours {ours}, Megatron {theirs}")
    return {"views_checked": checked, "mismatches": bad[:5], "num_mismatches": len(bad)}


# ------------------------------------------------------------------------------------------------ processes


def start_megatron(rank: int, case: dict, paths: dict):
    """Trainer rank `rank`: Megatron's process group and parallel state, the model with the HF weights loaded by
    mbridge, and the refit layout derived from the running model (`live_layout_doc`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from reshard_cli.formats import megatron as fmt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{paths['port']}", rank=rank,
                            world_size=case["trainers"])
    ps.initialize_model_parallel(tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"],
                                 expert_model_parallel_size=case["ep"])
    model = build_megatron(paths["hf"], case["tp"], case["pp"], case["ep"])
    return model, fmt.live_layout_doc(model, paths.get("layout_model", paths["hf"]))


def trainer(rank: int, case: dict, paths: dict) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from reshard_cli.formats import layout_from_doc
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit

    model, doc = start_megatron(rank, case, paths)
    layout = layout_from_doc(doc, file="<megatron model>")
    report = {"rank": rank, "metadata": check_sharded_metadata(model, layout, rank)}
    comm = refit_group("127.0.0.1", paths["refit_port"], rank, case["trainers"] + RECEIVERS)
    comm.all_gather_object(doc)
    refit = Refit(role="src", src=layout, dst=paths["dst"], mode="reshard", group=comm)
    stats = refit(dict(model.named_parameters()), verify_checksums=True)
    report.update(bytes_sent=stats.bytes_sent, checksums_ok=stats.checksums_ok, seconds=stats.seconds)
    comm.all_gather_object(report)
    os.makedirs(paths["dist_ckpt"], exist_ok=True)
    if not torch.cuda.is_available():  # megatron-core's torch_dist writer assumes a GPU in two calls
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    dist_checkpointing.save(model.sharded_state_dict(), paths["dist_ckpt"])
    dist.barrier()
    if rank == 0:
        with open(os.path.join(paths["dist_ckpt"], "reshard-layout.yaml"), "w") as f:
            import yaml
            f.write(yaml.safe_dump({k: v for k, v in doc.items() if k != "ranks"}, sort_keys=False))
    dist.destroy_process_group()


def receiver(index: int, case: dict, paths: dict) -> None:
    from reshard_cli.io.sources import SafetensorsSource
    from reshard_cli.formats import layout_from_doc, load_layout
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit
    from reshard_cli.transfer.shards import sentinel_buffers

    rank = case["trainers"] + index
    comm = refit_group("127.0.0.1", paths["refit_port"], rank, case["trainers"] + RECEIVERS)
    doc = next(d for d in comm.all_gather_object(None) if d is not None)
    src = layout_from_doc(doc, file="<megatron model>")
    dst = load_layout(paths["dst"])
    refit = Refit(role="dst", src=src, dst=dst, mode="reshard", group=comm)
    bufs = sentinel_buffers(dst, rank, torch.device("cpu"))
    names = [t.name for t in dst.manifest.tensors]
    stats = refit({names[t]: sh.data for t, sh in bufs.items()}, verify_checksums=True)
    wrong = elements = 0
    first_wrong = None
    with SafetensorsSource(dst.manifest, paths["hf"]) as hf:
        for t, sh in bufs.items():
            want = hf.read(t, sh.box)
            size = sh.data.element_size()
            got, exp = (x.contiguous().reshape(-1).view(torch.uint8).view(-1, size) for x in (sh.data, want))
            diff = int((got != exp).any(1).sum())  # elements whose bytes differ (bit for bit)
            wrong += diff
            elements += sh.data.numel()
            if diff and first_wrong is None:
                first_wrong = names[t]
    reports = comm.all_gather_object({"receiver": index, "elements": elements, "wrong": wrong,
                                      "first_wrong": first_wrong, "bytes_received": stats.bytes_received,
                                      "checksums_ok": stats.checksums_ok})
    if index == 0:
        with open(paths["report"], "w") as f:
            json.dump(reports, f)


# ------------------------------------------------------------------------------------------------ into vLLM


def trainer_engine(model, doc: dict, rank: int, paths: dict, client):
    """vLLM's trainer-side weight-transfer engine (`reshard` backend) over this rank's Megatron parameters."""
    import yaml
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard_cli.engines import vllm as vb

    vb.register()
    info = vb.ReshardTrainerInitInfo(
        host="127.0.0.1", port=paths["refit_port"], rank=rank, src=yaml.safe_dump(doc, sort_keys=False),
        dst=f"model: {os.path.join(paths['hf'], 'config.json')}\nformat: vllm\nmesh: {{tp: {paths['vllm_tp']}}}\n")
    return WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                     source=vb.ReshardSource(lambda: dict(model.named_parameters())))


def vllm_trainer(rank: int, case: dict, paths: dict) -> None:
    """Trainer ranks 1..: the same calls as rank 0 (which drives the engine), without the engine."""
    model, doc = start_megatron(rank, case, paths)
    trainer_engine(model, doc, rank, paths, None).send_weights()
    torch.distributed.destroy_process_group()


def run_vllm_case(name: str, root: str, vllm_tp: int) -> dict:
    """Megatron (weights A, loaded by mbridge) -> a running vLLM engine started from other weights (B): after
    one refit, vLLM's greedy tokens and logprobs must equal those of a fresh vLLM engine loading A itself."""
    import vllm_refit as vr

    from reshard_cli.base.ports import free_port
    from reshard_cli.engines.vllm.clients import LLMClient

    case = CASES[name]
    base = os.path.join(root, f"{name}-vllm-tp{vllm_tp}")
    hf = make_model(case["model"], base)
    start = make_model(case["model"], base, seed=1)
    paths = {"hf": hf, "port": free_port(), "refit_port": free_port(), "vllm_tp": vllm_tp}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if vllm_tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(vllm_tp))
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    logs = [os.path.join(base, f"trainer{i}.log") for i in range(1, case["trainers"])]
    procs = [subprocess.Popen([sys.executable, __file__, "--_proc", "vllm-trainer", str(i + 1), name,
                               json.dumps(paths)], stdout=open(log, "w"), stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]
    try:
        t0 = time.perf_counter()
        llm = vr.make_engine(start, vllm_tp, weight_transfer_config={"backend": "reshard"})
        print(f"[{name} -> vLLM tp{vllm_tp}] engine up in {time.perf_counter() - t0:.0f} s", flush=True)
        before = vr.generate(llm)
        model, doc = start_megatron(0, case, paths)
        report = trainer_engine(model, doc, 0, paths, LLMClient(llm)).send_weights()
        ours = vr.generate(llm)
        theirs = vr.reference(hf, vllm_tp)  # vLLM's own loader on the HF checkpoint, in a fresh engine
    finally:
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
    failed = next((log for p, log in zip(procs, logs) if p.returncode != 0), None)
    if failed:
        tail = [ln for ln in open(failed).read().splitlines() if ln.strip()]
        raise RuntimeError(f"{name}: {os.path.basename(failed)}: {tail[-1] if tail else 'failed'}")
    torch.distributed.destroy_process_group()
    del llm
    row = {"case": name, "vllm_tp": vllm_tp, "identical": ours == theirs, "changed": ours != before,
           **vr.summarize(report)}
    if not row["identical"]:
        row["first_difference"] = vr.first_difference(ours, theirs)
    return row


def run_case(name: str, root: str, attempts: int = 3) -> dict:
    """One case; a port another process took between choosing and binding it is retried with new ports."""
    for attempt in range(attempts):
        try:
            return _run_case(name, root)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == attempts - 1:
                raise
            print(f"[{name}] a chosen port was taken meanwhile ({e}); again with new ports", flush=True)


def _run_case(name: str, root: str) -> dict:
    import shutil

    from reshard_cli.base.ports import free_port

    shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    case = CASES[name]
    hf = make_model(case["model"], os.path.join(root, name))
    paths = {"hf": hf, "port": free_port(), "refit_port": free_port(), "dst": os.path.join(root, name, "dst.yaml"),
             "dist_ckpt": os.path.join(root, name, "dist_ckpt"), "report": os.path.join(root, name, "report.json")}
    if "layout_config" in case:  # the trainer (and the receivers) describe the model with another config
        config = json.load(open(os.path.join(hf, "config.json"))) | case["layout_config"]
        paths["layout_model"] = os.path.join(root, name, "other-config.json")
        with open(paths["layout_model"], "w") as f:
            json.dump(config, f)
    with open(paths["dst"], "w") as f:
        f.write(DST_LAYOUT.format(model=paths.get("layout_model", hf), first=case["trainers"],
                                  last=case["trainers"] + RECEIVERS - 1))
    roles = [(role, i) for role, n in (("trainer", case["trainers"]), ("receiver", RECEIVERS)) for i in range(n)]
    logs = [os.path.join(root, name, f"{role}{i}.log") for role, i in roles]
    procs = [subprocess.Popen([sys.executable, __file__, "--_proc", role, str(i), name, json.dumps(paths)],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT) for (role, i), log in zip(roles, logs)]
    deadline = time.monotonic() + 900
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break  # one failed: the others would wait for it until their timeout
        time.sleep(0.2)
    failed = None
    for p, log in zip(procs, logs):
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.returncode != 0 and failed is None:
            text = open(log).read()
            tail = [ln for ln in text.splitlines() if ln.strip()]
            failed = f"{os.path.basename(log)}: " + (tail[-1] if tail else f"exit {p.returncode}")

    if failed:
        if any("EADDRINUSE" in open(log).read() for log in logs):
            failed += " (EADDRINUSE)"
        raise RuntimeError(f"{name}: {failed}")
    with open(paths["report"]) as f:
        everyone = json.load(f)
    trainers = [r for r in everyone if "rank" in r]
    receivers = [r for r in everyone if "receiver" in r]
    result = {"case": name, **{k: case[k] for k in ("model", "tp", "pp", "ep", "trainers")},
              "hf": hf, "dist_ckpt": paths["dist_ckpt"], "dst": paths["dst"],
              "views_checked": sum(r["metadata"]["views_checked"] for r in trainers),
              "metadata_mismatches": sum(r["metadata"]["num_mismatches"] for r in trainers),
              "first_metadata_mismatches": next((r["metadata"]["mismatches"] for r in trainers
                                                 if r["metadata"]["mismatches"]), []),
              "elements": sum(r["elements"] for r in receivers), "wrong": sum(r["wrong"] for r in receivers),
              "first_wrong": next((r["first_wrong"] for r in receivers if r["first_wrong"]), None),
              "checksums_ok": all(r["checksums_ok"] for r in everyone),
              "wire_bytes": sum(r["bytes_sent"] for r in trainers),
              "refit_seconds": max(r["seconds"] for r in trainers)}
    return result


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_proc":  # internal: one trainer or receiver process
        role, i, name, paths = sys.argv[2], int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
        warnings.filterwarnings("ignore")
        {"trainer": trainer, "receiver": receiver, "vllm-trainer": vllm_trainer}[role](i, CASES[name], paths)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=[*CASES, "all"], nargs="+", default=["all"])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", help="where models and checkpoints go (default: a temp dir)")
    ap.add_argument("--vllm-tp", type=int, nargs="*", default=[],
                    help="also refit each case into a running vLLM engine (CPU build) of these TP sizes")
    ap.add_argument("--vllm-case", choices=list(CASES), nargs="+",
                    help="with --vllm-tp: only these cases into vLLM (default: every case run)")
    args = ap.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix="reshard-megatron-")
    results = []
    for name in [c for c in CASES if "layout_config" not in CASES[c]] if "all" in args.case else args.case:
        r = run_case(name, root)
        results.append(r)
        print(f"[{name}] {r['views_checked']} checkpoint views of Megatron's parameters vs its sharded_state_dict: "
              f"{r['metadata_mismatches']} mismatches; refit into a TP2 HF layout: {r['elements']} elements, "
              f"{r['wrong']} differ from the HF checkpoint mbridge loaded, checksums ok: {r['checksums_ok']}, "
              f"{r['wire_bytes'] / 1e6:.2f} MB on the wire in {r['refit_seconds']:.3f} s", flush=True)
        for vtp in args.vllm_tp if args.vllm_case is None or name in args.vllm_case else []:
            v = run_vllm_case(name, root, vtp)
            r.setdefault("vllm", []).append(v)
            print(f"[{name} -> vLLM tp{vtp}] refit {v['refit_seconds']:.3f} s, {v['wire_bytes'] / 1e6:.2f} MB on the "
                  f"wire, {v['bytes_into_each_worker'] / 1e6:.2f} MB into each worker, direct "
                  f"{v['direct_bytes_fraction']:.0%}; greedy tokens/logprobs identical to vLLM loading the HF "
                  f"checkpoint itself: {v['identical']}" + ("" if v["identical"] else f" ({v['first_difference']})")
                  + f"; changed from the engine's start weights: {v['changed']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(r["metadata_mismatches"] == 0 and r["wrong"] == 0 and r["checksums_ok"]
             and all(v["identical"] and v["checksums_ok"] for v in r.get("vllm", [])) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
