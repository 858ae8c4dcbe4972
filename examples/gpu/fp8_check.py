"""The FP8 quantize-on-send kernel on CUDA (`base.fp8`): its bytes beside the CPU result, and its speed beside
a device-to-device copy of the same BF16 bytes (goal: at least half the copy's GB/s).

On a GPU the scales round as vLLM's compiled quantizer rounds them there (see `base/fp8.py`), so scales may
differ from the CPU's in the last bit for some blocks; the line says how many, and whether the FP8 bytes of
the blocks whose scales agree are identical. Usage: python examples/gpu/fp8_check.py"""
import torch

from reshard_cli.base.fp8 import quantize_blocks


def seconds(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    if not torch.cuda.is_available():
        print("fp8 check: no CUDA device here")
        return
    g = torch.Generator().manual_seed(0)
    for shape in ((7168, 18432), (7168 + 64, 2048 + 100), (8, 2048, 7168)):
        x = torch.randn(shape, generator=g).to(torch.bfloat16)
        q_cpu, s_cpu = quantize_blocks(x)
        xd = x.cuda()
        q, s = quantize_blocks(xd)
        same_scale = s.cpu() == s_cpu
        rows = same_scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :shape[-2], :shape[-1]]
        bytes_equal = torch.equal(q.cpu().view(torch.uint8)[rows], q_cpu.view(torch.uint8)[rows])
        out = torch.empty_like(xd)
        t_q = seconds(lambda: quantize_blocks(xd, out=(q, s)))
        t_c = seconds(lambda: out.copy_(xd))
        nbytes = x.numel() * 2
        print(f"{list(shape)} bf16 {nbytes / 2**20:.0f} MiB: scales equal to CPU {int(same_scale.sum())}/"
              f"{same_scale.numel()}, FP8 bytes equal where scales are {bytes_equal}; quantize "
              f"{nbytes / t_q / 1e9:.0f} GB/s, D2D copy {nbytes / t_c / 1e9:.0f} GB/s "
              f"({100 * t_c / t_q:.0f} % of the copy)")


if __name__ == "__main__":
    main()
