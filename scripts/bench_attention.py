"""Paged attention at the shapes the stacks run (decode: one query token per row; an SMC verify: 9 per row; GQA 4 as
the Qwen3-8B, 8 as the 32B; 8 KV heads of 128, bf16), the planner's plan against the time to read the rows' K/V
once at the copy bandwidth (the roofline) and against the torch reference backend on the same batch.

    python scripts/bench_attention.py [--parts decode,verify,particles] [--out DIR]

particles: SMC particles in runs of 8 sharing their prompt (an 8B proposal step, a 32B verify; 1 and 16 requests),
read row by row (today's plan without runs) against once per run (cascade: the shared-prefix pass, then each row's
own columns), with the unique K/V read as the roofline.

The sweeps of launch settings behind the planner: scripts/sweep_kernels.py --parts attention,decode-forward.
"""

from __future__ import annotations

import torch
import triton.testing
from gpu_common import KV_HEADS, AttentionCase, ParticleCase, Report, run_parts

from hsmc.ops.backend import Rope, TorchBackend


def reference_us(case: AttentionCase) -> float:
    """The torch reference backend's attention (gathers and a masked softmax) on the case's batch, launched eagerly."""
    backend = TorchBackend()
    meta = backend.prepare(case.batch, Rope(torch.ones(64, device="cuda"), 1.0), torch.bfloat16)
    fn = lambda: backend.attend(0, case.q, case.cache, case.batch, meta)  # noqa: E731
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def time_cases(report: Report, label: str, tokens: int, cases: list[tuple[int, int, int]]) -> None:
    report.say(f"== {label} attention ({tokens} query tokens per row): planner vs K/V read roofline vs torch ==")
    for heads, rows, context in cases:
        case = AttentionCase(heads, rows, tokens, context)
        plan = case.planned()
        us, ref_us = case.us_per_call(plan), reference_us(case)
        bound_us = report.read_ms(case.kv_bytes) * 1e3
        report.say(
            f"G{heads // KV_HEADS} R{rows:<3} L{context:<5} plan {plan.splits}x{plan.block_n}/{plan.num_warps}w: "
            f"{us:7.1f} us, roofline {bound_us:6.1f} us ({bound_us / us:5.1%}), torch reference {ref_us:8.1f} us "
            f"({ref_us / us:5.1f}x slower)",
            kind=label, heads=heads, rows=rows, context=context, plan=str(plan), us=us, roofline_us=bound_us,
            torch_us=ref_us,
        )  # fmt: skip
        del case


def decode(report: Report) -> None:
    cases = [(32, 1, 260), (32, 1, 2000), (32, 1, 8192), (32, 8, 1100), (32, 16, 4096), (64, 8, 1100), (64, 16, 4096)]
    time_cases(report, "decode", 1, cases)


def verify(report: Report) -> None:
    cases = [(64, rows, context) for rows in (8, 16) for context in (268, 1100, 4400)] + [(32, 8, 1100)]
    time_cases(report, "verify", 9, cases)


def particles(report: Report) -> None:
    report.say("== SMC particles (runs of 8 over one prompt): row by row vs the shared prefix once per run ==")
    for requests in (16, 1):
        for heads, tokens, label in ((32, 1, "8B proposal"), (64, 9, "32B verify")):
            for prompt in (256, 2048):
                case = ParticleCase(heads, requests, 8, tokens, prompt, 16)
                by_row, by_run = case.planned(by_run=False), case.planned(by_run=True)
                error = (case.attend(by_run).float() - case.attend(by_row).float()).abs().max().item()
                row_us, run_us = case.us_per_call(by_row), case.us_per_call(by_run)
                bound_us = report.read_ms(case.unique_kv_bytes) * 1e3
                report.say(
                    f"{label:12s} {requests:2d} requests x 8 rows, prompt {prompt:5d} + 16: row by row "
                    f"{row_us:7.1f} us, once per run {run_us:7.1f} us ({row_us / run_us:4.2f}x), unique K/V read "
                    f"{bound_us:6.1f} us; max |diff| {error:.1e}",
                    label=label, requests=requests, prompt=prompt, row_us=row_us, run_us=run_us, bound_us=bound_us,
                    error=error,
                )  # fmt: skip
                del case


if __name__ == "__main__":
    torch.manual_seed(0)
    run_parts(__doc__.split("\n\n")[0], {"decode": decode, "verify": verify, "particles": particles}, "bench_attention")
