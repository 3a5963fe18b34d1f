"""The decoder-layer Linears of the Qwen3 shapes at the row counts of decoding, all layers chained in one CUDA graph,
against the time to read their weights once (the roofline) and the cuBLAS path in the same run:

one-row   one row (batch-1 decode): the fused one-row kernels (norm / SiLU prologue, residual epilogue) with and
          without programmatic dependent launch, against separate norm / SiLU kernels around cuBLAS (bf16) or the
          FP8 GEMM (FP8 weights); qwen3-8b bf16, qwen3-32b and qwen3-8b FP8.
few-row   2..16 rows (SMC proposals, batched requests): the few-row kernels against norm / SiLU kernels + cuBLAS,
          for qwen3-8b and qwen3-32b (bf16); then the whole 8B step at 1..16 rows with the few-row kernels and with
          cuBLAS.

    python scripts/bench_linears.py [--parts one-row,few-row] [--out DIR]

The tile sweeps behind the plans: scripts/sweep_kernels.py. FP8 Linears at verify sizes: scripts/bench_fp8.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gpu_common import (
    Report,
    few_row_chain,
    graph_ms,
    layer_dims,
    layer_linears,
    run_parts,
    time_8b_steps,
    weight_read_bytes,
)

from hsmc.ops import fused
from hsmc.ops.fp8_linear import QWEN_BLOCK


def one_row_chain(layers: list[dict], x: torch.Tensor, fused_kernels: bool) -> torch.Tensor:
    """A decoder's Linears at one row without attention (o reads the first columns of qkv): the fused one-row
    kernels, or separate norm / SiLU / add kernels around cuBLAS (bf16) or the FP8 GEMM."""
    from hsmc.ops.decode_linear import decode_linear
    from hsmc.ops.fp8_gemm import fp8_gemm

    def lin(t, w, **fuse):
        if fused_kernels:
            return decode_linear(t, w[0], scale=w[1], scale_block=QWEN_BLOCK, **fuse)
        return F.linear(t, w[0]) if w[1] is None else fp8_gemm(t, w[0], w[1], QWEN_BLOCK)

    q = layers[0]["o"][0].shape[1]
    stream = x
    for layer in layers:
        if fused_kernels:
            qkv = lin(stream, layer["qkv"], norm=(layer["norm1"], 1e-6))
            stream = lin(qkv[:, :q], layer["o"], residual=stream)
            gu = lin(stream, layer["gate_up"], norm=(layer["norm2"], 1e-6))
            stream = lin(gu, layer["down"], silu_mul=True, residual=stream)
        else:
            qkv = lin(fused.rms_norm(stream, layer["norm1"], 1e-6), layer["qkv"])
            stream = stream + lin(qkv[:, :q], layer["o"])
            gu = lin(fused.rms_norm(stream, layer["norm2"], 1e-6), layer["gate_up"])
            stream = stream + lin(fused.silu_mul(gu), layer["down"])
    return stream


def one_row(report: Report) -> None:
    report.say("== one row: fused one-row kernels (with / without PDL) vs separate kernels, all layers in a graph ==")
    for shape, fp8 in (("qwen3-8b", False), ("qwen3-32b", True), ("qwen3-8b", True)):
        time_one_row(report, shape, fp8)
        torch.cuda.empty_cache()


def time_one_row(report: Report, shape: str, fp8: bool) -> None:
    from hsmc.ops import pdl

    layers = layer_linears(shape, fp8)
    floor = report.read_ms(weight_read_bytes(layers, layer_dims(shape)))
    x = torch.randn(1, layer_dims(shape)["o"][0], device="cuda", dtype=torch.bfloat16)
    times = {"fused+pdl": graph_ms(lambda: one_row_chain(layers, x, True))}
    original = pdl.pdl_supported
    pdl.pdl_supported = lambda device: False
    try:
        times["fused"] = graph_ms(lambda: one_row_chain(layers, x, True))
        times["separate"] = graph_ms(lambda: one_row_chain(layers, x, False))
    finally:
        pdl.pdl_supported = original
    tag = f"{shape} {'fp8' if fp8 else 'bf16'}"
    cells = ", ".join(f"{k} {v:.3f} ms ({floor / v:.0%} of roofline)" for k, v in times.items())
    report.say(f"  {tag} M=1: weight read {floor:.3f} ms; {cells}; separate/fused+pdl "
               f"{times['separate'] / times['fused+pdl']:.2f}x", shape=tag, rows=1, weight_read_ms=floor,
               **times)  # fmt: skip


def few_row(report: Report) -> None:
    report.say("== 2..16 rows: few-row kernels vs norm / SiLU kernels + cuBLAS, all layers in a graph (bf16) ==")
    for shape in ("qwen3-8b", "qwen3-32b"):
        time_few_rows(report, shape)
        torch.cuda.empty_cache()
    time_8b_step_routes(report)


def time_few_rows(report: Report, shape: str) -> None:
    layers = layer_linears(shape, False)
    floor = report.read_ms(weight_read_bytes(layers, layer_dims(shape)))
    for m in (2, 4, 8, 16):
        x = torch.randn(m, layer_dims(shape)["o"][0], device="cuda", dtype=torch.bfloat16)
        times = {path: graph_ms(lambda p=path: few_row_chain(layers, x, p)) for path in ("cublas", "few")}
        report.say(f"  {shape} M={m}: weight read {floor:.3f} ms; cublas {times['cublas']:.3f} ms "
                   f"({floor / times['cublas']:.0%}), few-row {times['few']:.3f} ms ({floor / times['few']:.0%}); "
                   f"few/cublas {times['few'] / times['cublas']:.3f}", shape=shape, rows=m, weight_read_ms=floor,
                   **times)  # fmt: skip


def time_8b_step_routes(report: Report) -> None:
    """The whole 8B step with the router's routes (the few-row kernels up to 16 rows), and with every few-row route
    replaced by cuBLAS at the same rows."""
    from hsmc.ops.linear_router import Kernel, Route, router_for

    router = router_for(torch.device("cuda"))
    dense = router._dense

    def use(variant: str) -> None:
        router._routes.clear()
        router._dense = dense if variant == "few" else (lambda rows, n, k, norm_fed: Route(Kernel.BLAS, rows))

    try:
        steps = time_8b_steps((2, 4, 8, 16), ("cublas", "few"), use, rounds=1)
    finally:
        router._dense = dense
        router._routes.clear()
    for m, t in steps.items():
        report.say(f"  8B step M={m} (graph, 260 keys): weight read {t['weight_read_ms']:.3f} ms; cublas "
                   f"{t['cublas']:.3f} ms, few {t['few']:.3f} ms ({t['weight_read_ms'] / t['few']:.0%} of roofline); "
                   f"few/cublas {t['few'] / t['cublas']:.3f}", step_rows=m, **t)  # fmt: skip


if __name__ == "__main__":
    run_parts(__doc__.split("\n\n")[0], {"one-row": one_row, "few-row": few_row}, "bench_linears")
