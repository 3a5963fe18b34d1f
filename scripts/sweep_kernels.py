"""The kernel-tuning sweeps: on this GPU, every launch setting of a kernel over the Qwen3 shapes, the winners printed
as the entries of the per-GPU plan tables in hsmc/ops (and every timing written to --out). Each part is separate:

one-row         tile settings of the one-row (decode) Linears, qwen3-8b bf16 and qwen3-32b / qwen3-8b FP8, all layers
                of a kind chained with PDL (`decode_linear.plan_decode_linear`).
few-row         plans of the few-row Linears at 8 rows (the SMC proposal step's), bf16 qwen3-8b at TP 1 and 2 (one
                rank's shards), all layers of a kind chained with PDL: the router's plan against block_n x block_k x
                split_k x warps (`few_row_linear.FewRowPlan`), wider than `hsmc tune-kernels`' candidates.
fp8-gemm        launch settings of the weight-only FP8 GEMM around the planner's at 16 rows (`fp8_gemm.plan_fp8_gemm`).
w8a8            tile settings of the FP8-activation GEMM at verify sizes, 32B Linears, both operand orders
                (`fp8_gemm.plan_w8a8`).
fp8-routes      per Linear kind of the FP8 8B and 32B at proposal and verify rows, all layers chained: cuBLASLt's
                block-scaled GEMM against the Triton FP8-activation GEMM's tiles and K splits (`fp8_gemm.plan_w8a8`).
qkv-rope        the q/k norm + RoPE + KV write at 1..1152 tokens: heads per program x warps (`fused.qkv_rope_plan`).
quantizers      the quantizing norm (FP8 activations' prologue) at 8..1152 rows over warps, bit-equality checked at
                each (`fused.rms_norm_warps`).
attention       decode (1 query token per row) and verify (9) attention: the planner's plan against every query
                tile x split x key block x warps setting (`paged_attention.plan_attention`).
shared-prefix   16 requests of 8 SMC particles reading their prompt once: the shared-prefix pass's splits x key
                block x warps (`paged_attention.plan_shared_prefix`).
decode-forward  the whole qwen3-8b one-row forward with the attention plan forced to each setting, 260 and 2000 keys.

    python scripts/sweep_kernels.py --parts one-row[,...] [--out DIR]

The routes of the Linears (few-row plans, cuBLAS or cuBLASLt, padded rows, the block-scaled FP8 rows) are measured by
`hsmc tune-kernels`, which writes them as this GPU's tuning file (hsmc/ops/tuning/).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
from gpu_common import (
    LINEAR_STEPS,
    AttentionCase,
    ParticleCase,
    Report,
    graph_ms,
    layer_linears,
    run_parts,
    weight_read_bytes,
)

from hsmc.models.shapes import hf_config
from hsmc.ops import fused
from hsmc.ops.fp8_linear import QWEN_BLOCK
from hsmc.ops.triton_backend import TritonBackend


def one_row(report: Report) -> None:
    """Per Linear kind, all layers' instances chained with PDL at one row, over tile settings."""
    report.say("== one-row Linears: tile settings (rows per program, K tile, warps, stages, fused prologue) ==")
    for shape, fp8 in (("qwen3-8b", False), ("qwen3-32b", True), ("qwen3-8b", True)):
        sweep_one_row(report, shape, fp8)
        torch.cuda.empty_cache()


def sweep_one_row(report: Report, shape: str, fp8: bool) -> None:
    from hsmc.ops.decode_linear import DecodeLinearPlan, decode_linear

    layers = layer_linears(shape, fp8)
    tag = f"{shape} {'fp8' if fp8 else 'bf16'}"
    settings = (
        [(8, 1024, 4, 3, False), (8, 512, 4, 3, False), (4, 1024, 4, 3, False), (8, 1024, 4, 4, False),
         (16, 1024, 8, 3, False), (8, 1024, 4, 3, True)]
        if fp8 else
        [(8, 1024, 4, 1, True), (16, 512, 4, 1, True), (4, 1024, 4, 1, True), (8, 1024, 4, 1, False),
         (16, 512, 4, 1, False)]
    )  # fmt: skip
    for kind, step in LINEAR_STEPS.items():
        n, k = layers[0][kind][0].shape
        x = torch.randn(1, 2 * k if step.get("silu") else k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
        floor = report.read_ms(weight_read_bytes(layers, [kind]))
        rows = []
        for setting in settings:
            plan = DecodeLinearPlan(*setting)

            def chain(plan=plan):
                for layer in layers:
                    w, s = layer[kind]
                    norm = (layer["norm1"], 1e-6) if step.get("norm") else None
                    residual = res if step.get("residual") else None
                    silu = bool(step.get("silu"))
                    decode_linear(
                        x, w, scale=s, scale_block=QWEN_BLOCK, plan=plan, norm=norm, silu_mul=silu, residual=residual
                    )

            rows.append((setting, graph_ms(chain)))
        best, best_ms = min(rows, key=lambda r: r[1])
        report.say(f"  {tag} {kind} [{n}x{k}] x{len(layers)}: best {best}: {best_ms:.3f} ms ({floor / best_ms:.0%} of "
                   f"the weight read); " + " ".join(f"{s}:{ms:.3f}" for s, ms in rows),
                   shape=tag, kind=kind, weight_read_ms=floor, timings=[(str(s), ms) for s, ms in rows])  # fmt: skip


def few_row(report: Report) -> None:
    """8-row Linears in a graph, every layer of a kind chained as a forward chains them (its prologue kernel, PDL)."""
    from types import SimpleNamespace

    from hsmc.ops.few_row_linear import FewRowPlan, few_row_linear
    from hsmc.ops.linear_router import router_for

    report.say("== few-row Linears at 8 rows: the router's plan against (block_n, block_k, split_k, warps, stages) ==")
    router = router_for(torch.device("cuda", torch.cuda.current_device()))
    sweep = [FewRowPlan(bn, bk, split, warps, 4)
             for bn in (16, 32, 64) for bk in (128, 256) for split in (1, 2, 4) for warps in (2, 4)]  # fmt: skip
    for tp in (1, 2):
        layers = layer_linears("qwen3-8b", False, tp=tp)
        for kind, step in LINEAR_STEPS.items():
            n, k = layers[0][kind][0].shape
            x = torch.randn(8, 2 * k if step.get("silu") else k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(8, n, device="cuda", dtype=torch.bfloat16)
            routed = router.plan(x[:, :k].shape, SimpleNamespace(weight=layers[0][kind][0]), x.dtype).few_row_plan
            floor = report.read_ms(weight_read_bytes(layers, [kind]))

            def chain(plan: FewRowPlan) -> None:
                for layer in layers:
                    norm = (layer["norm1"], 1e-6) if step.get("norm") else None
                    few_row_linear(x, layer[kind][0], norm=norm, silu_mul=bool(step.get("silu")),
                                   residual=res if step.get("residual") else None, plan=plan)  # fmt: skip

            timed = {}
            for plan in (routed, *sweep):
                try:
                    timed[plan] = graph_ms(lambda plan=plan: chain(plan))
                except triton.runtime.errors.OutOfResources:
                    continue
            best = min(timed, key=timed.get)
            report.say(f"  qwen3-8b tp{tp} {kind} [{n}x{k}] x{len(layers)}: routed {timed[routed]:.3f} ms "
                       f"({floor / timed[routed]:.0%} of the weight read); best {best} {timed[best]:.3f} ms "
                       f"({timed[routed] / timed[best]:.2f}x)",
                       tp=tp, kind=kind, weight_read_ms=floor, routed=str(routed),
                       timings=[(str(p), ms) for p, ms in timed.items()])  # fmt: skip


def fp8_gemm(report: Report) -> None:
    from hsmc.ops.fp8_gemm import Fp8GemmPlan, fp8_gemm, plan_fp8_gemm
    from hsmc.ops.fp8_linear import quantize_fp8

    report.say("== weight-only FP8 GEMM at 16 rows: launch settings around the planner's ==")
    for name, (n, k) in {"32b.gate_up": (51200, 5120), "32b.qkv": (10240, 5120)}.items():
        w, s = quantize_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, QWEN_BLOCK)
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        default = plan_fp8_gemm(16, n, k, QWEN_BLOCK[1], torch.device("cuda"))
        plans = [default] + [Fp8GemmPlan(16, bn, 128, split, warps, 3)
                             for bn in (32, 64, 128) for split in (1, 2, 4) for warps in (4, 8)]  # fmt: skip
        floor = report.read_ms(w.numel() + s.numel() * 4)
        timed = [(triton.testing.do_bench(lambda p=p: fp8_gemm(x, w, s, QWEN_BLOCK, p), return_mode="median"), p)
                 for p in plans]  # fmt: skip
        best_ms, best = min(timed, key=lambda t: t[0])
        default_ms = timed[0][0]
        report.say(f"  M=16 {name}: planner {default} {default_ms * 1e3:.0f} us ({floor / default_ms:.0%} of the "
                   f"weight read); best {best} {best_ms * 1e3:.0f} us ({floor / best_ms:.0%})",
                   linear=name, weight_read_ms=floor, timings=[(str(p), t) for t, p in timed])  # fmt: skip


def w8a8(report: Report) -> None:
    """Both operand orders (s: swapped), the planner's choice first; all layers of a kind chained in a graph."""
    from hsmc.ops.fp8_gemm import W8A8Plan, plan_w8a8, w8a8_gemm
    from hsmc.ops.split_k import splits_to_fill

    report.say("== FP8-activation GEMM at verify sizes, qwen3-32b Linears: tile settings ==")
    layers = layer_linears("qwen3-32b", True)
    settings = [(64, 128, 4, 4, True), (128, 64, 4, 4, True), (64, 128, 4, 4, False), (64, 128, 4, 3, False),
                (128, 128, 8, 3, False), (128, 128, 4, 3, False), (64, 256, 8, 3, False), (128, 256, 8, 3, False),
                (64, 64, 4, 5, False), (32, 128, 4, 4, False)]  # fmt: skip
    device = torch.device("cuda")
    for m in (72, 144, 256):
        totals: dict[str, float] = {}
        floor = report.read_ms(weight_read_bytes(layers, LINEAR_STEPS))
        for kind, step in LINEAR_STEPS.items():
            n, k = layers[0][kind][0].shape
            x = torch.randn(m, 2 * k if step.get("silu") else k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if step.get("residual") else None

            def plan_of(bm, bn, warps, stages, swap, n=n, k=k):
                split = splits_to_fill(triton.cdiv(n, bn) * triton.cdiv(m, bm), triton.cdiv(k, 128), device)
                return W8A8Plan(bm, bn, split, warps, stages, swap)

            plans = {"planned": plan_w8a8(m, n, k, 128, device)}
            plans |= {f"{'s' if st[4] else 'n'}{st[0]}x{st[1]}/{st[2]}/{st[3]}": plan_of(*st) for st in settings}
            for label, plan in plans.items():

                def chain(plan=plan, kind=kind, step=step, x=x, res=res):
                    for layer in layers:
                        h = fused.rms_norm(x, layer["norm1"], 1e-6) if step.get("norm") else x
                        h = fused.silu_mul(h) if step.get("silu") else h
                        w8a8_gemm(h, *layer[kind], QWEN_BLOCK, plan, res)

                try:
                    ms = graph_ms(chain)
                except Exception as e:  # a setting that does not compile is a sweep result
                    report.say(f"  M={m} {kind} {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                totals[label] = totals.get(label, 0.0) + ms
        ranked = sorted(totals.items(), key=lambda t: t[1])
        report.say(f"  w8a8 32B M={m}: weight read {floor:.3f} ms; "
                   + ", ".join(f"{label} {ms:.2f} ms ({floor / ms:.0%})" for label, ms in ranked),
                   rows=m, weight_read_ms=floor, totals=totals)  # fmt: skip


def fp8_routes(report: Report) -> None:
    """Per Linear kind, every layer chained in a graph with its quantizing prologue (norm / SiLU / none) as a forward
    runs it: cuBLASLt's block-scaled GEMM (the residual added after) against the Triton GEMM at its planned tiles
    and at swept tiles and K splits (the residual added as it rounds)."""
    from hsmc.ops.fp8_gemm import (
        W8A8Plan,
        block_scaled_matmul,
        plan_w8a8,
        quantize_groups,
        rms_norm_quantize,
        silu_mul_quantize,
        w8a8_matmul,
    )

    report.say("== FP8-activation routes per Linear kind: cuBLASLt against the Triton GEMM, layers chained ==")
    settings = [(64, 64, 1, True), (64, 64, 2, True), (64, 64, 4, True), (128, 64, 1, True), (128, 64, 2, True),
                (128, 128, 1, False)]  # fmt: skip
    cases = {"qwen3-8b": (8, 128), "qwen3-32b": (72, 144, 1152)}
    for shape, row_counts in cases.items():
        layers = layer_linears(shape, True)
        for m in row_counts:
            for kind, step in LINEAR_STEPS.items():
                n, k = layers[0][kind][0].shape
                x = torch.randn(m, 2 * k if step.get("silu") else k, device="cuda", dtype=torch.bfloat16)
                res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if step.get("residual") else None
                floor = report.read_ms(weight_read_bytes(layers, [kind]))

                def quantize(layer, rows, column_major, step=step, x=x):
                    layout = dict(rows=rows, column_major_scales=column_major)
                    if step.get("norm"):
                        return rms_norm_quantize(x, layer["norm1"], 1e-6, 128, **layout)
                    if step.get("silu"):
                        return silu_mul_quantize(x, 128, **layout)
                    return quantize_groups(x, 128, **layout)

                def cublaslt(layers=layers, kind=kind, res=res, m=m, quantize=quantize):
                    for layer in layers:
                        q, s = quantize(layer, -(-m // 4) * 4, True)
                        out = block_scaled_matmul(q, s, *layer[kind], torch.bfloat16, m)
                        if res is not None:
                            out = res + out

                def triton_gemm(plan, layers=layers, kind=kind, res=res, m=m, quantize=quantize):
                    for layer in layers:
                        q, s = quantize(layer, m, False)
                        w8a8_matmul(q, s, *layer[kind], QWEN_BLOCK, torch.bfloat16, plan, res)

                plans = {"planned": plan_w8a8(m, n, k, 128, torch.device("cuda"))}
                plans |= {f"{'s' if swap else 'n'}{bm}x{bn}/k{split}": W8A8Plan(bm, bn, split, 4, 4, swap)
                          for bm, bn, split, swap in settings}  # fmt: skip
                timed = {"cublaslt": graph_ms(cublaslt)}
                for label, plan in plans.items():
                    try:
                        timed[label] = graph_ms(lambda plan=plan: triton_gemm(plan))
                    except Exception as e:  # a setting that does not compile is a sweep result
                        report.say(f"  {label}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                best = min(timed, key=timed.get)
                report.say(f"  {shape} M={m} {kind} [{n}x{k}] x{len(layers)}: cublaslt {timed['cublaslt']:.3f} ms "
                           f"({floor / timed['cublaslt']:.0%} of the weight read), triton planned "
                           f"{timed.get('planned', float('nan')):.3f}; best {best} {timed[best]:.3f} ms "
                           f"({timed['cublaslt'] / timed[best]:.2f}x cublaslt)",
                           shape=shape, rows=m, kind=kind, weight_read_ms=floor, timings=timed)  # fmt: skip


def qkv_rope(report: Report) -> None:
    """The q/k norm + RoPE + KV write at decode, proposal and verify token counts: heads per program x warps."""
    from hsmc.ops.backend import HeadLayout

    report.say("== q/k norm + RoPE + KV write: heads per program x warps ==")
    for shape, heads in {"qwen3-8b": HeadLayout(32, 8, 128), "qwen3-32b": HeadLayout(64, 8, 128)}.items():
        for tokens in (1, 8, 72, 128, 1152):
            width = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
            qkv = torch.randn(1, tokens, width, device="cuda", dtype=torch.bfloat16)
            slots = torch.randperm(4 * tokens + 64, device="cuda")[:tokens]
            keys = torch.empty(4 * tokens + 64, heads.num_kv_heads, heads.head_dim, device="cuda",
                               dtype=torch.bfloat16)  # fmt: skip
            values = torch.empty_like(keys)
            positions = torch.arange(tokens, device="cuda") + 300
            inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
            norm_w = torch.ones(128, device="cuda", dtype=torch.bfloat16)
            moved = tokens * (width + 2 * heads.num_kv_heads * heads.head_dim + heads.num_heads * heads.head_dim) * 2
            timed = {}
            for plan in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (16, 4), (16, 8)):

                def run(plan=plan):
                    for _ in range(20):
                        fused.qkv_rope_store(qkv, heads.num_heads, heads.num_kv_heads, heads.head_dim,
                                             (norm_w, norm_w, 1e-6), positions, inv_freq, 1.0, slots, keys, values,
                                             heads_per_program=plan)  # fmt: skip

                timed[plan] = graph_ms(run) / 20 * 1e3
            best = min(timed, key=timed.get)
            report.say(f"  {shape} {tokens} tokens: one head a program {timed[(1, 1)]:.1f} us, planned "
                       f"{fused.qkv_rope_plan(tokens)} {timed[fused.qkv_rope_plan(tokens)]:.1f} us, best {best} "
                       f"{timed[best]:.1f} us ({report.read_ms(moved) * 1e3:.1f} us at the copy bandwidth)",
                       shape=shape, tokens=tokens, timings_us=[(str(p), t) for p, t in timed.items()])  # fmt: skip


def quantizers(report: Report) -> None:
    """The quantizing norm at proposal and verify rows (and `fused.rms_norm`, whose sum order it shares) over warps,
    each setting's codes checked bit for bit against quantize_groups(rms_norm(x)) at the same warps."""
    from unittest.mock import patch

    from hsmc.ops import fp8_gemm
    from hsmc.ops.fp8_gemm import quantize_groups, rms_norm_quantize

    report.say("== the quantizing norm over warps ==")
    default_warps = fused.rms_norm_warps
    for k in (4096, 5120):
        w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        for rows in (8, 128, 1152):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            moved = rows * k * 3  # bf16 read, e4m3 written
            timed, exact, bf16 = {}, {}, {}
            for warps in (2, 4, 8, 16):
                forced = lambda block, warps=warps: warps  # noqa: E731
                with patch.object(fused, "rms_norm_warps", forced), patch.object(fp8_gemm, "rms_norm_warps", forced):
                    q, s = rms_norm_quantize(x, w, 1e-6, 128)
                    want_q, want_s = quantize_groups(fused.rms_norm(x, w, 1e-6), 128)
                    exact[warps] = torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
                    timed[warps] = graph_ms(lambda: [rms_norm_quantize(x, w, 1e-6, 128) for _ in range(20)]) / 20 * 1e3
                    bf16[warps] = graph_ms(lambda: [fused.rms_norm(x, w, 1e-6) for _ in range(20)]) / 20 * 1e3
            planned = default_warps(triton.next_power_of_2(k))
            best = min(timed, key=timed.get)
            report.say(f"  rms_norm_quantize K={k} rows={rows}: {planned} warps {timed[planned]:.1f} us, best {best} "
                       f"warps {timed[best]:.1f} us ({report.read_ms(moved) * 1e3:.1f} us at the copy bandwidth); "
                       f"bit-equal at every setting: {all(exact.values())}; rms_norm (bf16 out) "
                       + ", ".join(f"{w_}w {t:.1f}" for w_, t in bf16.items()),
                       kernel="rms_norm_quantize", k=k, rows=rows, timings_us=timed, exact=exact,
                       rms_norm_us=bf16)  # fmt: skip


def attention(report: Report) -> None:
    from hsmc.ops.paged_attention import AttentionPlan

    decode_cases = [(32, 8, 1100), (32, 8, 4400), (32, 16, 300), (32, 16, 2000), (32, 16, 4096), (32, 32, 2000),
                    (32, 128, 272), (32, 128, 2064), (64, 8, 1100), (64, 16, 4096)]  # fmt: skip
    verify_cases = [(64, rows, context) for rows in (8, 16, 128) for context in (268, 1100, 2200, 4400)]
    verify_cases += [(32, rows, context) for rows in (8, 128) for context in (268, 1100, 4400)]
    for label, tokens, cases, warps in (("decode", 1, decode_cases, (2, 4, 8)), ("verify", 9, verify_cases, (4, 8))):
        report.say(f"== {label} attention ({tokens} query tokens per row): the planner vs every setting (us) ==")
        for heads, rows, context in cases:
            case = AttentionCase(heads, rows, tokens, context)
            current = case.planned()
            reference = case.attend(current).float()
            group = heads // 8
            whole_row = min(triton.next_power_of_2(tokens), max(1, 128 // group))  # a row's queries in one tile
            timings = {}
            for block_t in sorted({current.block_t, whole_row}):
                block_m = max(16, triton.next_power_of_2(block_t * group))
                for splits in (1, 2, 4, 8, 16):
                    for block_n in (32, 64, 128):
                        for w in warps:
                            plan = AttentionPlan(block_t, block_m, splits, block_n, w)
                            if not torch.allclose(case.attend(plan).float(), reference, atol=2e-2, rtol=2e-2):
                                report.say(f"  H{heads} R{rows} L{context} {plan}: differs from the planner's output")
                                continue
                            timings[(block_t, splits, block_n, w)] = case.us_per_call(plan)
            now = case.us_per_call(current)
            bound = report.read_ms(case.kv_bytes) * 1e3
            ranked = sorted(timings, key=timings.get)[:4]
            report.say(f"G{group} R{rows:<3} L{context:<5} planner t{current.block_t} {current.splits}x"
                       f"{current.block_n}/{current.num_warps}w {now:6.1f} us ({bound / now:.0%} of the K/V read); "
                       "best (block_t, splits, block_n, warps): " + ", ".join(f"{k} {timings[k]:.1f}" for k in ranked),
                       kind=label, heads=heads, rows=rows, context=context, planner_us=now, roofline_us=bound,
                       timings={str(k): v for k, v in timings.items()})  # fmt: skip
            del case


def shared_prefix(report: Report) -> None:
    """The shared-prefix pass's splits and key blocks at 16 requests of 8 particles (`plan_shared_prefix`)."""
    report.say("== runs of 8 particles reading their prompt once: the planner vs each shared-pass setting (us) ==")
    for heads, tokens in ((32, 1), (64, 9)):
        for prompt in (256, 2048):
            case = ParticleCase(heads, 16, 8, tokens, prompt, 16)
            current, shared = case.planned(by_run=True), case.shared()
            reference = case.attend(case.planned(by_run=False)).float()
            timings = {}
            for splits in (1, 2, 4, 8):
                for block_n in (32, 64, 128):
                    for w in (4, 8):
                        pass_plan = replace(current.shared, splits=splits, block_n=block_n, num_warps=w)
                        plan = replace(current, shared=pass_plan)
                        if not torch.allclose(case.attend(plan, shared).float(), reference, atol=2e-2, rtol=2e-2):
                            report.say(f"  H{heads} T{tokens} L{case.context} {plan}: differs from row by row")
                            continue
                        timings[(splits, block_n, w)] = case.us_per_call(plan, shared)
            now = case.us_per_call(current, shared)
            ranked = sorted(timings, key=timings.get)[:4]
            s = current.shared
            report.say(f"G{heads // 8} T{tokens} 16 x 8 rows, L{case.context:<5} planner {s.splits}x{s.block_n}/"
                       f"{s.num_warps}w {now:6.1f} us; best (splits, block_n, warps): "
                       + ", ".join(f"{k} {timings[k]:.1f}" for k in ranked),
                       heads=heads, tokens=tokens, context=case.context, planner_us=now,
                       timings={str(k): v for k, v in timings.items()})  # fmt: skip
            del case


def decode_forward(report: Report) -> None:
    """Where the planner's choice shows in the step time: attention sits on the chain of dependent kernels."""
    import hsmc.ops.triton_backend as triton_backend
    from hsmc.bench import timed
    from hsmc.engine.kv_pool import BlockTables, SlotAllocator
    from hsmc.engine.runner import ModelRunner
    from hsmc.models.config import DecoderConfig
    from hsmc.models.shapes import random_model
    from hsmc.ops.paged_attention import AttentionPlan

    report.say("== decode attention plans inside the 8B one-row forward ==")
    cfg = DecoderConfig.from_hf(hf_config("qwen3-8b"))
    tables = BlockTables(SlotAllocator(8192, "cuda"), 1, 8192)
    runner = ModelRunner(random_model(cfg, torch.bfloat16, "cuda"), tables, TritonBackend(), cfg.num_layers,
                         cuda_graphs=True)  # fmt: skip
    rows, one = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.ones(1, dtype=torch.int64, device="cuda")
    planner = triton_backend.plan_attention
    try:
        for context in (260, 2000):
            with torch.inference_mode():
                tables.release(rows, 8192)
                prompt = torch.randint(0, 1000, (1, context), device="cuda")
                runner.forward(runner.new_tokens(rows, prompt, one * context, context), True)
            timings = {}
            settings = [AttentionPlan(4, 16, s, b, w) for s in (1, 2, 4, 8, 16) for b in (32, 64, 128) for w in (2, 4)]
            for plan in [None, *settings]:
                triton_backend.plan_attention = planner if plan is None else (lambda *a, p=plan: p)
                runner.graphs.captured.clear()  # recaptured with this variant
                tokens = torch.randint(0, 1000, (1, 1), device="cuda")
                back = torch.full_like(rows, context)
                with torch.inference_mode():
                    step = lambda: runner.forward(runner.new_tokens(rows, tokens, one, context + 1), True)  # noqa: E731
                    step()
                    tables.truncate(rows, back, 1)
                    t = timed(lambda: [(step(), tables.truncate(rows, back, 1)) for _ in range(50)]) / 50
                timings["planner" if plan is None else f"{plan.splits}x{plan.block_n}/{plan.num_warps}w"] = t * 1e3
            best = min(timings, key=timings.get)
            report.say(f"context {context}: planner {timings['planner']:.3f} ms per forward; best {best} "
                       f"{timings[best]:.3f} ms; " + " ".join(f"{k}:{v:.3f}" for k, v in timings.items()),
                       context=context, timings=timings)  # fmt: skip
    finally:
        triton_backend.plan_attention = planner


if __name__ == "__main__":
    parts = {"one-row": one_row, "few-row": few_row, "fp8-gemm": fp8_gemm, "w8a8": w8a8, "fp8-routes": fp8_routes,
             "qkv-rope": qkv_rope, "quantizers": quantizers, "attention": attention, "shared-prefix": shared_prefix,
             "decode-forward": decode_forward}  # fmt: skip
    run_parts(__doc__.split("\n\n")[0], parts, "sweep_kernels")
