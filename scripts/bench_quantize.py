"""The quantizing prologues of the FP8-activation GEMMs (issue 30 item 6): RMSNorm and SiLU·mul that write e4m3 rows
and their 1x128 scales in one kernel (`rms_norm_quantize`, `silu_mul_quantize`), against the two kernels they
replace (`fused.rms_norm` / `fused.silu_mul`, then `quantize_groups`) in the same run, at the rows of a 16-request
SMC cycle (128 proposal rows, 1152 verify tokens), with each kernel's memory roofline (bytes read and written at the
measured copy bandwidth) and a check that both give the same bits.

    python scripts/bench_quantize.py [--shapes qwen3-32b,qwen3-8b] [--rows 128,1152]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing
from gpu_common import layer_dims

from hsmc.bench import copy_bandwidth
from hsmc.ops import fused
from hsmc.ops.fp8_gemm import quantize_groups, rms_norm_quantize, silu_mul_quantize

GROUP = 128


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3


def same_bits(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-32b,qwen3-8b")
    parser.add_argument("--rows", default="128,1152")
    args = parser.parse_args()
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    print(f"device {torch.cuda.get_device_name(dev)}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")  # fmt: skip
    print(f"{'shape':>10} {'prologue':>8} {'rows':>5} {'K':>6} {'bound us':>8} {'two kernels':>11} {'fused':>7} "
          f"{'fused x bound':>13} {'two / fused':>11} same bits")  # fmt: skip
    for shape in args.shapes.split(","):
        hidden = layer_dims(shape)["o"][0]
        inner = layer_dims(shape)["down"][1]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
            weight = 1 + 0.2 * torch.randn(hidden, device=dev, dtype=torch.bfloat16)
            gate_up = torch.randn(m, 2 * inner, device=dev, dtype=torch.bfloat16)
            cases = {
                "norm": (
                    hidden,
                    2 * m * hidden,  # bf16 rows read
                    lambda: quantize_groups(fused.rms_norm(x, weight, 1e-6), GROUP),
                    lambda: rms_norm_quantize(x, weight, 1e-6, GROUP),
                ),
                "silu": (
                    inner,
                    2 * m * 2 * inner,
                    lambda: quantize_groups(fused.silu_mul(gate_up), GROUP),
                    lambda: silu_mul_quantize(gate_up, GROUP),
                ),
            }
            for name, (k, read, two, one) in cases.items():
                written = m * k + 4 * m * (k // GROUP)  # e4m3 rows and fp32 scales
                bound = (read + written) / bandwidth * 1e6
                t_two, t_one, same = us(two), us(one), same_bits(two(), one())
                print(f"{shape:>10} {name:>8} {m:>5} {k:>6} {bound:8.1f} {t_two:11.1f} {t_one:7.1f} "
                      f"{t_one / bound:12.2f}x {t_two / t_one:10.2f}x {same}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
