"""FP8 Linears of the Qwen3 shapes at the row counts hsmc runs: the Triton block-scaled GEMMs (FP8 activations, and
weight-only up to 256 rows) against cuBLASLt's block-scaled FP8 GEMM (`torch._scaled_mm` with 1x128 activation and
128x128 weight scales, CUDA >= 12.9 on Hopper), the weight dequantized then bf16 cuBLAS (the weight-only route past
256 rows) and bf16 cuBLAS on the dequantized weight (the baseline), with the FP8 tensor-core bound and the weight
read at the measured copy bandwidth.

    python scripts/bench_fp8_gemm.py [--shapes qwen3-32b,qwen3-8b] [--rows 8,144,1152] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from gpu_common import FP8_PEAK_FLOPS

from hsmc.bench import copy_bandwidth
from hsmc.ops.fp8_gemm import fp8_gemm, quantize_groups, w8a8_matmul
from hsmc.ops.fp8_linear import QWEN_BLOCK, dequantize_fp8, quantize_fp8

LINEARS = {  # name: [(linear, N, K)]
    "qwen3-32b": [("qkv", 10240, 5120), ("o", 5120, 8192), ("gate_up", 51200, 5120), ("down", 5120, 25600)],
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
}


def cublas_scales(q_scale: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layouts `_scaled_mm` reads block scales in: activations [M, K/128] column-major, weights (as the
    K x N operand) [K/128, N/128] column-major, i.e. the checkpoint's [N/128, K/128] transposed (K/128 a
    multiple of 4 in every Qwen3 Linear)."""
    return q_scale.t().contiguous().t(), w_scale.t()


def scaled_mm(q, q_scale_cm, w, w_scale_t) -> torch.Tensor:
    return torch._scaled_mm(q, w.t(), scale_a=q_scale_cm, scale_b=w_scale_t, out_dtype=torch.bfloat16)


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-32b,qwen3-8b")
    parser.add_argument("--rows", default="1,8,16,64,144,288,576,1152")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = FP8_PEAK_FLOPS
    bandwidth = copy_bandwidth(dev)
    print(f"device {name}; torch {torch.__version__}, CUDA {torch.version.cuda}; FP8 peak {peak / 1e12:.0f} TFLOP/s; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for shape in args.shapes.split(","):
        for linear, n, k in LINEARS[shape]:
            w_bf16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
            w, w_scale = quantize_fp8(w_bf16, QWEN_BLOCK)
            w_dense = dequantize_fp8(w, w_scale, QWEN_BLOCK, torch.bfloat16)
            for m in rows_list:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                q, q_scale = quantize_groups(x, 128)
                row = {"shape": shape, "linear": linear, "n": n, "k": k, "m": m}
                # the tensor cores' time, or the time to read the FP8 weight and its scales once
                bound = max(2 * m * n * k / peak, (n * k + w_scale.numel() * 4) / bandwidth)
                row["bound_ms"] = bound * 1e3
                row["triton_w8a8_ms"] = ms(lambda: w8a8_matmul(q, q_scale, w, w_scale, QWEN_BLOCK, torch.bfloat16))
                ref = w8a8_matmul(q, q_scale, w, w_scale, QWEN_BLOCK, torch.bfloat16).float()
                if m <= 256:
                    row["triton_weight_only_ms"] = ms(lambda: fp8_gemm(x, w, w_scale, QWEN_BLOCK))
                row["dequantize_cublas_ms"] = ms(lambda: F.linear(x, dequantize_fp8(w, w_scale, QWEN_BLOCK, x.dtype)))
                row["bf16_cublas_ms"] = ms(lambda: F.linear(x, w_dense))
                try:
                    a_s, b_s = cublas_scales(q_scale, w_scale)
                    out = scaled_mm(q, a_s, w, b_s).float()
                    row["cublaslt_rel_err_vs_triton"] = ((out - ref).norm() / ref.norm()).item()
                    row["cublaslt_ms"] = ms(lambda: scaled_mm(q, a_s, w, b_s))
                    with_layout = lambda: scaled_mm(q, cublas_scales(q_scale, w_scale)[0], w, b_s)  # noqa: E731
                    row["cublaslt_with_scale_layout_ms"] = ms(with_layout)
                except RuntimeError as e:
                    row["cublaslt_error"] = str(e)[:600]
                results.append(row)
                fields = " ".join(
                    f"{key[:-3]} {value:.3f} ({row['bound_ms'] / value:.0%})"
                    for key, value in row.items()
                    if key.endswith("_ms") and key != "bound_ms"
                )
                rel_err = row.get("cublaslt_rel_err_vs_triton", float("nan"))
                extra = row.get("cublaslt_error") or f"rel err {rel_err:.1e}"
                print(
                    f"{shape} {linear} [{n}x{k}] M={m}: bound {row['bound_ms']:.3f} ms; {fields}; {extra}", flush=True
                )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_fp8_gemm.json").write_text(
            json.dumps({"device": name, "copy_bandwidth": bandwidth, "rows": results}, indent=1)
        )


if __name__ == "__main__":
    main()
