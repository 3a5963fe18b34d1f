"""The Triton backend against the torch reference: paged attention over random ragged batches, each fused
kernel, and whole models (logits and greedy decoding). Without a GPU these run through Triton's
interpreter (conftest sets TRITON_INTERPRET=1), on small shapes; tests/gpu/test_kernels_on_cuda.py runs the
same comparisons compiled on the GPU over real sizes and context lengths up to 8k."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from conftest import make_tiny_model
from helpers import make_runner, run_new_tokens

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from hsmc.decoder import HierarchicalDecoder  # noqa: E402
from hsmc.eagle.checkpoint import random_eagle3_head  # noqa: E402
from hsmc.models.decoder import RMSNorm  # noqa: E402
from hsmc.models.loading import load_model  # noqa: E402
from hsmc.ops import fused  # noqa: E402
from hsmc.ops.backend import HeadLayout, Rope, TorchBackend, rms_norm_reference  # noqa: E402
from hsmc.ops.batch import ForwardBatch, padded_columns  # noqa: E402
from hsmc.ops.decode_linear import DecodeLinearPlan, decode_linear  # noqa: E402
from hsmc.ops.few_row_linear import MAX_ROWS, FewRowPlan, few_row_linear  # noqa: E402
from hsmc.ops.fp8_linear import Fp8Linear, dequantize_fp8, quantize_fp8  # noqa: E402
from hsmc.ops.kernel_tuning import DEFAULTS, packaged_tunings  # noqa: E402
from hsmc.ops.kv_cache import KVCache  # noqa: E402
from hsmc.ops.linear_router import LinearRouter  # noqa: E402
from hsmc.ops.paged_attention import (  # noqa: E402
    AttentionPlan,
    paged_attention,
    plan_attention,
    shared_columns,
    shares_prefix,
)
from hsmc.ops.triton_backend import TritonBackend  # noqa: E402
from hsmc.ops.tune_kernels import FP8_ONE_ROW_CANDIDATES, ONE_ROW_CANDIDATES  # noqa: E402
from hsmc.training.ttt import ttt_attention_batch  # noqa: E402

INTERPRETED = not torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"
# the interpreter has no bf16 dot and truncates (not rounds) bf16 stores: bf16 is checked on the GPU
FLOATS = [torch.float32, torch.float16] if INTERPRETED else [torch.float32, torch.float16, torch.bfloat16]
ATTN_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_batch(rng: random.Random, rows: int, tokens: int, max_start: int, slots: int) -> ForwardBatch:
    """Ragged rows (0..tokens new tokens, contexts 0..max_start) over a shuffled block table."""
    table = torch.randperm(slots)[: (rows + 1) * (max_start + tokens)].view(rows + 1, -1)
    table = torch.cat([table, torch.full((rows + 1, 1), slots)], 1).to(DEVICE)
    start = torch.tensor([rng.randint(0, max_start) for _ in range(rows)], device=DEVICE)
    num_new = torch.tensor([rng.randint(1, tokens) for _ in range(rows)], device=DEVICE)
    row_ids = torch.randperm(rows + 1)[:rows].to(DEVICE)
    cols = padded_columns(start, num_new, tokens)
    valid = torch.arange(tokens, device=DEVICE)[None] < num_new[:, None]
    write = torch.where(valid, table[row_ids[:, None], cols], slots)
    context = int((start + num_new).max())
    zeros = torch.zeros(rows, tokens, dtype=torch.int64, device=DEVICE)
    return ForwardBatch(row_ids, table, zeros, cols, write, start, num_new, context)


def reference_attention(q, cache, batch):
    meta = TorchBackend().prepare(batch, Rope(torch.ones(1, device=DEVICE), 1.0), q.dtype)
    return TorchBackend().attend(0, q, cache, batch, meta).view(q.shape)


def max_error(out, ref, batch):
    """Over the real tokens (padding rows' outputs are ignored)."""
    return max((out[i, :n] - ref[i, :n]).abs().max().item() for i, n in enumerate(batch.num_new.tolist()) if n)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,tokens,max_start",
    [(4, 4, 16, 1, 70), (8, 2, 16, 5, 40), (6, 2, 32, 3, 90), (4, 1, 64, 9, 20)],
    ids=["mha-decode", "gqa4-verify", "gqa3-chunk", "mqa-d64"],
)
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_attention_matches_reference(dtype, heads, kv_heads, head_dim, tokens, max_start, splits):
    rng = random.Random(hash((heads, tokens, splits)) % 1000)
    torch.manual_seed(rng.randint(0, 999))
    slots = 400
    batch = random_batch(rng, 3, tokens, max_start, slots)
    cache = KVCache(1, slots, kv_heads, head_dim, dtype, DEVICE)
    cache.data.normal_()
    q = torch.randn(3, tokens, heads, head_dim, dtype=dtype, device=DEVICE)
    plan = plan_attention(3, tokens, batch.max_context, heads, kv_heads, 4)
    out = paged_attention(
        q, cache.keys(0), cache.values(0), batch.table, batch.rows, batch.start, batch.num_new,
        AttentionPlan(plan.block_t, plan.block_m, splits),
    )  # fmt: skip
    assert max_error(out.float(), reference_attention(q, cache, batch).float(), batch) <= ATTN_TOL[dtype]


def test_paged_attention_with_an_explicit_mask():
    """A random visibility pattern (each query sees at least its own column) replaces causality."""
    rng = random.Random(7)
    torch.manual_seed(7)
    batch = random_batch(rng, 3, 4, 30, 300)
    seen = torch.rand(3, 4, batch.max_context, device=DEVICE) < 0.5
    seen |= torch.arange(batch.max_context, device=DEVICE)[None, None] == batch.query_cols[:, :, None]
    masked = ForwardBatch(**{**batch.__dict__, "mask": seen})
    cache = KVCache(1, 300, 2, 16, torch.float32, DEVICE)
    cache.data.normal_()
    q = torch.randn(3, 4, 4, 16, device=DEVICE)
    out = paged_attention(
        q, cache.keys(0), cache.values(0), masked.table, masked.rows, masked.start, masked.num_new,
        plan_attention(3, 4, masked.max_context, 4, 2, 4), seen,
    )  # fmt: skip
    assert max_error(out, reference_attention(q, cache, masked), masked) <= 1e-5


def batch_in_runs(rng: random.Random, rows: int, run: int, tokens: int, slots: int) -> ForwardBatch:
    """Rows in runs of `run` that fork from one prefix each (0..40 shared columns, then 0..30 of their own), one of
    them padding (no new tokens): the shape of an SMC cycle's particles."""
    perm = torch.randperm(slots).tolist()
    table = torch.full((rows + 1, 40 + 30 + tokens + 1), slots)
    start = []
    for i in range(rows):
        if i % run == 0:
            prefix = [perm.pop() for _ in range(rng.randint(0, 40))]
        own = rng.randint(0, 30)
        columns = prefix + [perm.pop() for _ in range(own + tokens)]
        table[i, : len(columns)] = torch.tensor(columns)
        start.append(len(prefix) + own)
    start_t = torch.tensor(start, device=DEVICE)
    num_new = torch.tensor([rng.randint(1, tokens) for _ in range(rows)], device=DEVICE)
    num_new[rows - 2] = 0
    row_ids = torch.arange(rows, device=DEVICE)
    table = table.to(DEVICE)
    cols = padded_columns(start_t, num_new, tokens)
    valid = torch.arange(tokens, device=DEVICE)[None] < num_new[:, None]
    write = torch.where(valid, table[row_ids[:, None], cols], slots)
    zeros = torch.zeros(rows, tokens, dtype=torch.int64, device=DEVICE)
    return ForwardBatch(row_ids, table, zeros, cols, write, start_t, num_new, int((start_t + num_new).max()))


def common_prefixes(batch: ForwardBatch, run: int) -> list[int]:
    """Per run: the leading columns its rows with new tokens hold in the same slots, before the first new one."""
    out = []
    for first in range(0, len(batch.rows), run):
        active = [i for i in range(first, min(first + run, len(batch.rows))) if batch.num_new[i] > 0]
        bound = min((int(batch.start[i]) for i in active), default=0)
        n = 0
        while n < bound and len({int(batch.table[batch.rows[i], n]) for i in active}) == 1:
            n += 1
        out.append(n)
    return out


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,tokens,run,splits",
    [(4, 2, 16, 1, 3, 1), (8, 2, 16, 5, 3, 2), (4, 4, 32, 3, 4, 1), (6, 2, 16, 2, 2, 4)],
    ids=["decode-runs-of-3", "verify-split", "mha-runs-of-4", "gqa3-runs-of-2"],
)
def test_paged_attention_reading_shared_prefixes_once_per_run_matches_reference(
    dtype, heads, kv_heads, head_dim, tokens, run, splits
):
    """Cascade attention: each run's common prefix (found in the tables, padding rows left out) attended once for all
    its queries, in two splits, then each row's own columns from that state, equals attention row by row."""
    rng = random.Random(heads * 7 + tokens)
    torch.manual_seed(heads + tokens)
    slots, rows = 2000, 7
    batch = batch_in_runs(rng, rows, run, tokens, slots)
    shared = shared_columns(batch.table, batch.rows, batch.start, batch.num_new, run)
    assert shared[:, 0].tolist() == common_prefixes(batch, run)
    assert max(shared[:, 0].tolist()) > 0
    cache = KVCache(1, slots + 1, kv_heads, head_dim, dtype, DEVICE)
    cache.data.normal_()
    q = torch.randn(rows, tokens, heads, head_dim, dtype=dtype, device=DEVICE)
    plan = plan_attention(rows, tokens, batch.max_context, heads, kv_heads, 4, run=run)
    plan = dataclasses.replace(plan, splits=splits, shared=dataclasses.replace(plan.shared, splits=2))
    out = paged_attention(
        q, cache.keys(0), cache.values(0), batch.table, batch.rows, batch.start, batch.num_new, plan, shared=shared
    )
    assert max_error(out.float(), reference_attention(q, cache, batch).float(), batch) <= ATTN_TOL[dtype]


def test_smc_particles_read_their_prompt_once_and_decode_the_same_tokens(tmp_path, monkeypatch):
    """An SMC stack through the Triton backend, its shared-prefix path opened to 2 requests and short prompts: its
    particles' forwards read each request's shared prefix once (the found prefixes are not empty), and the particle
    system samples the same tokens at T = 1 as with attention row by row (same seed, same Philox draws)."""
    import hsmc.ops.paged_attention as paged
    import hsmc.ops.triton_backend as triton_backend

    monkeypatch.setattr(paged, "MIN_SHARED_RUNS", 1)
    monkeypatch.setattr(paged, "MIN_SHARED_CONTEXT", 1)
    monkeypatch.setattr(paged, "MIN_SHARED_CONTEXT_ONE_TOKEN", 1)

    draft, target = make_tiny_model("llama", tmp_path / "d", seed=1), make_tiny_model("llama", tmp_path / "t", seed=2)
    cfg = {
        "levels": [
            {"model": str(draft), "temperature": 1.0},
            {"kind": "smc", "model": str(target), "temperature": 1.0, "particles": 4, "block_size": 3},
        ],
        "engine": {"device": DEVICE, "attention": "triton"},
    }
    found: list[int] = []

    def recorded(*args):
        shared = shared_columns(*args)
        found.append(int(shared[:, 0].max()))
        return shared

    outputs = []
    for sharing in (True, False):
        if sharing:
            monkeypatch.setattr(triton_backend, "shared_columns", recorded)
        else:
            monkeypatch.setattr(triton_backend, "shares_prefix", lambda *args: False)
        decoder = HierarchicalDecoder.from_config(cfg)
        outputs.append(decoder.generate([[5, 9, 13, 2, 7], [7, 7]], max_new_tokens=8, ignore_eos=True, seed=3))
    assert max(found) >= 2, found  # the prompts' columns, at least
    assert [r.token_ids for r in outputs[0]] == [r.token_ids for r in outputs[1]]


def test_particles_read_their_prefix_once_only_where_that_was_measured_faster():
    """16 requests of 8 particles over more than 512 keys (1.55-1.82x on an H200), and their proposal steps (one
    token a row) in the 512-key bucket (1.19x at 272 keys); not a verify there (0.98x), not one request
    (0.45-0.66x), not a tree-masked verify, not a prefill chunk, not rows that come in no runs."""
    assert shares_prefix(128, 1, 2048, 8, False) and shares_prefix(128, 9, 2048, 8, False)
    assert shares_prefix(128, 1, 512, 8, False) and not shares_prefix(128, 1, 256, 8, False)
    assert not shares_prefix(128, 9, 512, 8, False) and not shares_prefix(8, 1, 2048, 8, False)
    assert not shares_prefix(128, 9, 2048, 8, True) and not shares_prefix(128, 64, 2048, 8, False)
    assert not shares_prefix(128, 1, 2048, 1, False)


def test_attention_of_many_rows_takes_the_throughput_plans():
    """On 132 SMs, 16 requests' particles (128 rows, >= 4 programs per SM) are bound by throughput: a 9-token verify
    row's queries in one tile over 32-key blocks (1.07-1.15x on an H200), decode rows over <= 512 keys in 64-key
    blocks of 2 warps (1.10x), a run's shared prefix in two splits of 128-key blocks (1.07-1.22x) or, for verify
    rows, in 32-key blocks (1.11-1.15x); 16 verify rows
    and 8 decode rows keep the latency plans."""
    assert plan_attention(128, 9, 268, 64, 8, 132) == AttentionPlan(16, 128, 1, block_n=32, num_warps=4)
    assert plan_attention(128, 9, 268, 32, 8, 132) == AttentionPlan(16, 64, 1, block_n=32, num_warps=4)
    assert plan_attention(16, 9, 1100, 64, 8, 132) == AttentionPlan(8, 64, 1, block_n=64, num_warps=4)
    assert plan_attention(128, 1, 512, 32, 8, 132) == AttentionPlan(4, 16, 1, block_n=64, num_warps=2)
    assert (plan_attention(8, 1, 512, 32, 8, 132).block_n, plan_attention(8, 1, 512, 32, 8, 132).num_warps) == (128, 4)
    shared = plan_attention(128, 1, 512, 32, 8, 132, run=8).shared
    assert (shared.splits, shared.block_n) == (2, 128)
    shared = plan_attention(128, 9, 2048, 64, 8, 132, run=8).shared
    assert (shared.splits, shared.block_m, shared.block_n) == (1, 64, 32)
    assert plan_attention(2, 128, 1024, 32, 8, 132).block_t == 16  # a prefill chunk keeps its plan


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("heads,tokens", [(16, 9), (8, 9), (4, 1)], ids=["gqa8-verify", "gqa4-verify", "decode"])
def test_throughput_plans_match_the_reference(dtype, heads, tokens):
    """The plans the planner takes with many programs per SM (here one SM): whole-row query tiles of up to 128
    queries over 32-key blocks, and 2-warp 64-key blocks for decode rows, equal the reference."""
    rng = random.Random(heads + tokens)
    torch.manual_seed(heads * tokens)
    slots = 400
    ragged = random_batch(rng, 3, tokens, 90, slots)
    num_new = torch.tensor([tokens, 1, max(1, tokens - 3)], device=DEVICE)  # a full row: every query of the tile
    cols = padded_columns(ragged.start, num_new, tokens)
    valid = torch.arange(tokens, device=DEVICE)[None] < num_new[:, None]
    write = torch.where(valid, ragged.table[ragged.rows[:, None], cols], slots)
    context = int((ragged.start + num_new).max())
    batch = ForwardBatch(ragged.rows, ragged.table, ragged.tokens, cols, write, ragged.start, num_new, context)
    plan = plan_attention(3, tokens, batch.max_context, heads, 2, 1)
    assert plan.block_n == (32 if tokens > 1 else 64) and plan.block_t >= tokens
    cache = KVCache(1, slots, 2, 16, dtype, DEVICE)
    cache.data.normal_()
    q = torch.randn(3, tokens, heads, 16, dtype=dtype, device=DEVICE)
    out = paged_attention(
        q, cache.keys(0), cache.values(0), batch.table, batch.rows, batch.start, batch.num_new, plan
    )  # fmt: skip
    assert max_error(out.float(), reference_attention(q, cache, batch).float(), batch) <= ATTN_TOL[dtype]


def exact_or_ulp(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of b's dtype resolution at the values' scale (0 = bit-exact)."""
    eps = torch.finfo(b.dtype).eps
    return ((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1) * eps)).max().item()


def ulps_allowed(dtype: torch.dtype) -> float:
    """fp32 sums run in a different order than torch's (a few ulps); 16-bit results round the same fp32
    value, so they agree up to one rounding step."""
    return 16 if dtype == torch.float32 else 1


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_fused_norm_and_silu_mul_match_reference(dtype):
    torch.manual_seed(1)
    x = torch.randn(3, 5, 96, device=DEVICE, dtype=dtype) * 3
    weight = (1 + 0.2 * torch.randn(96, device=DEVICE)).to(dtype)
    tol = ulps_allowed(dtype)
    assert exact_or_ulp(fused.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)) <= tol
    gate_up = torch.randn(4, 2 * 80, device=DEVICE, dtype=dtype) * 2
    gate, up = gate_up.chunk(2, -1)
    assert exact_or_ulp(fused.silu_mul(gate_up), F.silu(gate) * up) <= tol


def decode_linear_reference(x, w, bias=None, norm=None, silu=False, residual=None):
    """The same function in fp64: what every rounding of the kernel approximates."""
    x, w = x.double(), w.double()
    if norm is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm[1]) * norm[0].double()
    if silu:
        gate, up = x.chunk(2, -1)
        x = F.silu(gate) * up
    y = F.linear(x, w, None if bias is None else bias.double())
    return y if residual is None else residual.double() + y


def _linear_tolerance(dtype: torch.dtype) -> float:
    """Relative error of a fused Linear against the fp64 reference: 16-bit outputs take up to four roundings
    (two in the prologue, the output, the residual add) of half an ulp each; the torch reference in bf16 is
    itself up to 3.3e-3 off here (compiled on an H200, where a tolerance of 2e-3 failed both kernels)."""
    return 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("prologue", ["none", "rms_norm", "silu_mul"])
@pytest.mark.parametrize("epilogue", ["none", "bias", "residual", "both"])
@pytest.mark.parametrize("n,k,block_k", [(40, 72, 32), (96, 300, 128)], ids=["tiles", "ragged-k"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "prologue-kernel"])
def test_decode_linear_matches_reference(dtype, prologue, epilogue, n, k, block_k, fuse):
    """One row through the fused kernel: K tiles with a ragged end, N not a multiple of the rows per program."""
    torch.manual_seed(n + k)
    x = torch.randn(1, 1, 2 * k if prologue == "silu_mul" else k, device=DEVICE, dtype=dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    norm = ((torch.rand(k, device=DEVICE) + 0.5).to(dtype), 1e-6) if prologue == "rms_norm" else None
    bias = torch.randn(n, device=DEVICE).to(dtype) if epilogue in ("bias", "both") else None
    residual = torch.randn(1, 1, n, device=DEVICE).to(dtype) if epilogue in ("residual", "both") else None
    out = decode_linear(
        x, w, bias=bias, norm=norm, silu_mul=prologue == "silu_mul", residual=residual,
        plan=DecodeLinearPlan(8, block_k, fuse_prologue=fuse),
    )  # fmt: skip
    ref = decode_linear_reference(x, w, bias, norm, prologue == "silu_mul", residual)
    assert out.shape == ref.shape and out.dtype == dtype
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < _linear_tolerance(dtype)


@pytest.mark.parametrize("plan", ONE_ROW_CANDIDATES, ids=str)
def test_one_row_plans_the_sweep_may_record_are_exact(plan):
    """Every plan `hsmc tune-kernels` may write for the one-row kernel gives the reference's result, as a norm-fed
    Linear and as a down (SiLU·mul before it, the residual after): N ragged against its rows, K against its tile."""
    torch.manual_seed(plan.block_n)
    n, k = 2 * plan.block_n + 3, 2 * plan.block_k + 40
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(torch.float32)
    for kwargs, ref in _norm_fed_and_down_cases(w):
        out = decode_linear(weight=w, plan=plan, **kwargs)
        assert ((out.double() - ref).norm() / ref.norm()).item() < _linear_tolerance(torch.float32)


def _norm_fed_and_down_cases(real: torch.Tensor) -> list[tuple[dict, torch.Tensor]]:
    """One row through a weight whose real value is `real` [N, K]: (decode_linear's keywords, the reference) as a
    norm-fed Linear and as a down (SiLU·mul of [gate | up] before it, a residual after)."""
    n, k = real.shape
    x, gate_up = torch.randn(1, k, device=DEVICE), torch.randn(1, 2 * k, device=DEVICE)
    norm, residual = (torch.rand(k, device=DEVICE) + 0.5, 1e-6), torch.randn(1, n, device=DEVICE)
    return [({"x": x, "norm": norm}, decode_linear_reference(x, real, None, norm)),
            ({"x": gate_up, "silu_mul": True, "residual": residual},
             decode_linear_reference(gate_up, real, None, None, True, residual))]  # fmt: skip


@pytest.mark.parametrize("plan", FP8_ONE_ROW_CANDIDATES, ids=str)
def test_fp8_one_row_plans_the_sweep_may_record_are_exact(plan):
    """Every plan `hsmc tune-kernels` may write for FP8 weights (128x128 scale blocks) gives the dequantized matmul's
    result, norm-fed and as a down: N ragged against its rows and the scale blocks, K against its tile."""
    torch.manual_seed(plan.block_n * plan.block_k)
    n, k = 128 + 2 * plan.block_n + 8, plan.block_k + 168
    w, scale = quantize_fp8(torch.randn(n, k, device=DEVICE) / k**0.5, (128, 128))
    real = dequantize_fp8(w, scale, (128, 128), torch.float32)
    for kwargs, ref in _norm_fed_and_down_cases(real):
        out = decode_linear(weight=w, scale=scale, scale_block=(128, 128), plan=plan, **kwargs)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("n,k,block_n,block_k", [(256, 384, 8, 128), (136, 300, 16, 256), (64, 520, 4, 512)])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "prologue-kernel"])
def test_decode_linear_fp8_matches_dequantized_matmul(n, k, block_n, block_k, fuse):
    """FP8 weights: K tiles of several scale blocks with a ragged last block; a program's rows in one scale row."""
    torch.manual_seed(n)
    w, scale = quantize_fp8(torch.randn(n, k) / k**0.5, (128, 128))
    x = torch.randn(1, k)
    norm = (torch.rand(k) + 0.5, 1e-6)
    residual = torch.randn(1, n)
    out = decode_linear(
        x.to(DEVICE), w.to(DEVICE), scale=scale.to(DEVICE), scale_block=(128, 128), norm=(norm[0].to(DEVICE), 1e-6),
        residual=residual.to(DEVICE), plan=DecodeLinearPlan(block_n, block_k, fuse_prologue=fuse),
    ).cpu()  # fmt: skip
    ref = decode_linear_reference(x, dequantize_fp8(w, scale, (128, 128), torch.float32), norm=norm, residual=residual)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("rows", [2, 7, 16, 23, 32])
@pytest.mark.parametrize("prologue", ["none", "rms_norm", "silu_mul"])
@pytest.mark.parametrize("epilogue", ["none", "bias", "residual", "both"])
@pytest.mark.parametrize(
    "plan",
    [FewRowPlan(32, 64), FewRowPlan(16, 128, num_warps=4), FewRowPlan(32, 32, split_k=3)],
    ids=["32x64", "16x128", "split-k"],
)
def test_few_row_linear_matches_reference(dtype, rows, prologue, epilogue, plan):
    """2..16 rows on the tensor cores: N not a multiple of the program's weight rows, ragged K (in split-K, a
    ragged last split), strided rows; the norm / SiLU·mul as their own kernel before it."""
    torch.manual_seed(rows)
    n, k = 40, 300
    width = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(rows, 1, width + 24, device=DEVICE, dtype=dtype)[..., :width]  # rows 24 values apart
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    norm = ((torch.rand(k, device=DEVICE) + 0.5).to(dtype), 1e-6) if prologue == "rms_norm" else None
    bias = torch.randn(n, device=DEVICE).to(dtype) if epilogue in ("bias", "both") else None
    residual = torch.randn(rows, 1, n, device=DEVICE).to(dtype) if epilogue in ("residual", "both") else None
    out = few_row_linear(
        x, w, bias=bias, norm=norm, silu_mul=prologue == "silu_mul", residual=residual, plan=plan
    )  # fmt: skip
    ref = decode_linear_reference(x, w, bias, norm, prologue == "silu_mul", residual)
    assert out.shape == ref.shape and out.dtype == dtype
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < _linear_tolerance(dtype)


@pytest.mark.parametrize(
    "source, plan",
    sorted({(t.source, plan) for t in packaged_tunings() for plan in t.few_row_plans.values()}, key=str),
    ids=str,
)
def test_tuned_few_row_plans_are_exact(source, plan):
    """Each plan of the packaged tuning files gives the reference's result at its tiles (N and K ragged against
    them, the residual epilogue)."""
    torch.manual_seed(0)
    rows = 13
    n, k = 2 * plan.block_n + 8, plan.split_k * plan.num_stages * plan.block_k + 40
    x = torch.randn(rows, k, device=DEVICE)
    w = torch.randn(n, k, device=DEVICE) / k**0.5
    residual = torch.randn(rows, n, device=DEVICE)
    out = few_row_linear(x, w, residual=residual, plan=plan)
    ref = decode_linear_reference(x, w, None, None, False, residual)
    assert ((out.double() - ref).norm() / ref.norm()).item() < _linear_tolerance(torch.float32)


def tuned(monkeypatch, **tables):
    """The Triton backend routes with `tables` as this device's tuning."""
    import hsmc.ops.triton_backend as triton_backend

    tuning = dataclasses.replace(DEFAULTS, **tables)
    monkeypatch.setattr(triton_backend, "router_for", lambda device: LinearRouter(tuning, device))


@pytest.mark.parametrize("fp8", [False, True], ids=["dense", "fp8"])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_backend_linears_match_reference(fp8, rows):
    """The backend's three Linear steps (one row: the fused kernel; up to 16 dense: norm/SiLU kernels + the
    few-row kernel; more, or FP8: + a GEMM with the residual) against the reference backend on the same modules."""
    torch.manual_seed(rows)
    k, n = 256, 128
    dense = torch.nn.Linear(k, n, bias=False)
    down = torch.nn.Linear(k, n, bias=False)
    if fp8:
        dense, down = (fp8_module(m) for m in (dense, down))
    dense, down = dense.to(DEVICE), down.to(DEVICE)
    norm = RMSNorm(k, 1e-6).to(DEVICE)
    norm.weight.data = torch.rand(k, device=DEVICE) + 0.5
    stream = torch.randn(rows, 1, k, device=DEVICE)
    gate_up = torch.randn(rows, 1, 2 * k, device=DEVICE)
    residual = torch.randn(rows, 1, n, device=DEVICE)
    outs = []
    for backend in (TritonBackend(), TorchBackend()):
        with torch.no_grad():
            outs.append(
                [
                    backend.linear(stream, dense),
                    backend.linear(stream, dense, residual.clone()),  # a residual is consumed
                    backend.norm_linear(stream, norm, dense),
                    backend.silu_linear(gate_up, down, residual.clone()),
                ]
            )
    for got, want in zip(*outs):
        assert got.shape == want.shape
        assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("measured", [False, True], ids=["no-32-row-plan", "32-row-plan"])
@pytest.mark.parametrize("rows", [1, 2, 16, 17, MAX_ROWS, MAX_ROWS + 1])
def test_backend_routes_few_rows_to_the_few_row_kernel(rows, measured, dtype, monkeypatch):
    """2..16 rows of dense half-precision weights take `few_row_linear` in all three Linear steps, 17..32 only where
    the GPU has a measured 32-row plan for the weight; one row and more rows do not, nor fp32 rows (exact IEEE dots,
    off the tensor cores)."""
    import hsmc.ops.triton_backend as triton_backend

    tuned(monkeypatch, few_row_plans={(32, 64, 32): FewRowPlan(32, 64)} if measured else {})  # weights [32, 64]

    calls = []
    kernel = triton_backend.few_row_linear
    monkeypatch.setattr(triton_backend, "few_row_linear", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    k, n = 64, 32
    dense, down = torch.nn.Linear(k, n).to(DEVICE, dtype), torch.nn.Linear(k, n).to(DEVICE, dtype)
    norm = RMSNorm(k, 1e-6).to(DEVICE, dtype)
    backend = TritonBackend()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE, dtype=dtype)

    with torch.no_grad():
        backend.linear(randn(rows, 1, k), dense, randn(rows, 1, n))
        backend.norm_linear(randn(rows, 1, k), norm, dense)
        backend.silu_linear(randn(rows, 1, 2 * k), down, randn(rows, 1, n))
    few = 2 <= rows <= 16 or (measured and 17 <= rows <= MAX_ROWS)
    assert len(calls) == (3 if few and dtype != torch.float32 else 0)


@pytest.mark.parametrize("listed", [False, True], ids=["torch-choice", "measured-cublaslt"])
def test_dense_gemms_switch_to_cublaslt_only_where_measured_faster(listed, monkeypatch):
    """A GEMM of the backend (more than 32 rows) runs inside cuBLASLt exactly when this GPU's tuning lists its weight
    shape and row count; torch's library is restored after it (also when the GEMM raises), and the result is the
    same GEMM's."""
    library = ["cublas"]
    seen = []

    def preferred(backend=None):  # torch's setter/getter; the CPU build refuses cuBLASLt, so it is recorded here
        if backend is not None:
            library[0] = backend
        return library[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    k, n, rows = 64, 32, MAX_ROWS + 8
    tuned(monkeypatch, cublaslt_gemms=frozenset({(n, k, rows)} if listed else {(n, k, rows + 1), (k, n, rows)}))
    gemm = torch.nn.functional.linear
    monkeypatch.setattr(F, "linear", lambda *a: seen.append(library[0]) or gemm(*a))
    dense = torch.nn.Linear(k, n, bias=False).to(DEVICE)
    x = torch.randn(rows, 1, k, device=DEVICE)
    with torch.no_grad():
        got = TritonBackend().linear(x, dense)
    assert seen == ["cublaslt" if listed else "cublas"] and library == ["cublas"]
    assert torch.equal(got, gemm(x, dense.weight))

    def failing(*a):
        seen.append(library[0])
        raise RuntimeError("a failing GEMM")

    monkeypatch.setattr(F, "linear", failing)
    with pytest.raises(RuntimeError, match="a failing GEMM"):
        TritonBackend().linear(x, dense)
    assert seen[-1] == ("cublaslt" if listed else "cublas") and library == ["cublas"]


@pytest.mark.parametrize("listed", [False, True], ids=["own-rows", "measured-padding"])
def test_norm_fed_gemms_run_at_the_measured_rows(listed, monkeypatch):
    """A GEMM after an RMSNorm (more than 32 rows) runs at the rows this GPU's tuning lists for its weight shape and
    row count, and returns the same rows as the reference backend, in the input's shape."""
    k, n, rows = 64, 48, MAX_ROWS + 8
    table = {(n, k, rows): rows + 24} if listed else {(n, k, rows + 1): rows + 24, (k, n, rows): rows + 24}
    tuned(monkeypatch, padded_rows=table)
    seen = []
    gemm = torch.nn.functional.linear
    monkeypatch.setattr(F, "linear", lambda x, *a: seen.append(x.numel() // x.shape[-1]) or gemm(x, *a))
    torch.manual_seed(0)
    dense = torch.nn.Linear(k, n, bias=False).to(DEVICE)
    norm = RMSNorm(k, 1e-6).to(DEVICE)
    norm.weight.data = torch.rand(k, device=DEVICE) + 0.5
    stream = torch.randn(rows // 2, 2, k, device=DEVICE)
    with torch.no_grad():
        got = TritonBackend().norm_linear(stream, norm, dense)
        seen_by_triton = list(seen)
        want = TorchBackend().norm_linear(stream, norm, dense)
    assert seen_by_triton == [rows + 24 if listed else rows]
    assert got.shape == want.shape == (rows // 2, 2, n)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def fp8_module(linear: torch.nn.Linear) -> Fp8Linear:
    module = Fp8Linear(linear.in_features, linear.out_features, False, (128, 128))
    w, scale = quantize_fp8(linear.weight.detach(), (128, 128))
    module.weight.data, module.weight_scale_inv.data = w, scale
    return module


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qk-norm"])
@pytest.mark.parametrize("plan", [(1, 1), (2, 1), (8, 4)], ids=["head", "2-heads", "8-heads"])
def test_fused_qkv_rope_and_kv_write_match_reference(dtype, qk_norm, plan, monkeypatch):
    """Every head grouping (8 heads a program: more than the 4 q and 2 kv heads, masked) writes the reference's q
    and KV."""
    monkeypatch.setattr(fused, "qkv_rope_plan", lambda tokens: plan)
    torch.manual_seed(2)
    heads = HeadLayout(4, 2, 16)
    batch = random_batch(random.Random(2), 3, 4, 12, 90)
    batch = ForwardBatch(**{**batch.__dict__, "positions": batch.query_cols * 3 + 5})  # positions != columns
    qkv = torch.randn(3, 4, (4 + 2 * 2) * 16, device=DEVICE, dtype=dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, device=DEVICE).float() / 16))
    rope = Rope(inv_freq, 0.9)
    norms = (
        (
            (1 + 0.2 * torch.randn(16, device=DEVICE)).to(dtype),
            (1 + 0.2 * torch.randn(16, device=DEVICE)).to(dtype),
            1e-6,
        )
        if qk_norm
        else None
    )
    results = []
    for backend in (TritonBackend(), TorchBackend()):
        cache = KVCache(1, 90, 2, 16, dtype, DEVICE)
        q = backend.qkv_to_cache(0, qkv, heads, norms, cache, batch, backend.prepare(batch, rope, dtype))
        results.append((q, cache.data[:, :, :90]))
    (q, kv), (q_ref, kv_ref) = results
    valid = torch.arange(4, device=DEVICE)[None] < batch.num_new[:, None]
    assert exact_or_ulp(q[valid], q_ref[valid]) <= ulps_allowed(dtype)
    assert exact_or_ulp(kv, kv_ref) <= ulps_allowed(dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # plain, and q/k norms (qwen2's bias is a Linear's)
def test_whole_model_logits_match_reference(arch, tmp_path):
    model = load_model(str(make_tiny_model(arch, tmp_path / arch)), device=DEVICE).model
    rng = random.Random(3)
    contexts = [[rng.randrange(80) for _ in range(n)] for n in (4, 1, 6)]
    new = [[rng.randrange(80) for _ in range(k)] for k in (1, 3, 2)]
    runs = []
    for backend in (TritonBackend(), TorchBackend()):
        runner = make_runner(model, device=DEVICE, backend=backend, capture=(1, 2))
        # 18 token rows (GEMM: the residual added in place, so captured streams must be copies), then 9
        runs.append([run_new_tokens(runner, [0, 1, 2], contexts), run_new_tokens(runner, [0, 1, 2], new)])
    for (got, got_features), (want, want_features) in zip(*runs):
        for i in range(3):
            assert (got[i] - want[i]).abs().max() <= 1e-4
            assert (got_features[i] - want_features[i]).abs().max() <= 1e-4


def test_greedy_decode_through_triton_equals_reference(tmp_path):
    path = make_tiny_model("qwen3", tmp_path / "m")
    prompts = [[5, 9, 13], [7] * 6]
    outputs = []
    for attention in ("triton", "torch"):
        cfg = {"levels": [{"model": str(path)}], "engine": {"device": DEVICE, "attention": attention}}
        outputs.append(HierarchicalDecoder.from_config(cfg).generate(prompts, max_new_tokens=6, ignore_eos=True))
    assert [r.token_ids for r in outputs[0]] == [r.token_ids for r in outputs[1]]


def test_greedy_rejection_stack_through_triton_equals_the_reference(tmp_path):
    """Every device step of a stack runs through its backend (token rows, KV slots appended and rolled back, the
    draws): a greedy rejection stack through the Triton backend decodes the reference's tokens. (Sampled draws
    differ by design: the Triton sampler's noise comes from Philox counters, the reference's from splitmix64.)"""
    small, big = make_tiny_model("qwen3", tmp_path / "s", seed=3), make_tiny_model("qwen3", tmp_path / "b", seed=4)
    levels = [{"model": str(small)}, {"kind": "rejection", "model": str(big), "num_draft_tokens": 2}]
    outputs = []
    for attention in ("triton", "torch"):
        cfg = {"levels": levels, "engine": {"device": DEVICE, "attention": attention}}
        outputs.append(HierarchicalDecoder.from_config(cfg).generate([[5, 9, 13]], max_new_tokens=5))
    assert [r.token_ids for r in outputs[0]] == [r.token_ids for r in outputs[1]]


def test_tree_verify_forward_through_triton_equals_the_reference(tmp_path):
    """A draft tree's verify forward: its nodes attend under a tree mask in the Triton paged attention (RoPE
    positions by depth); logits equal the reference backend's, and each node's equal a plain forward of the prompt
    followed by its path."""
    from helpers import make_state

    from hsmc.levels.tree import Tree, ancestors

    model = load_model(str(make_tiny_model("qwen3", tmp_path / "m", seed=4))).model.to(DEVICE)
    parent = torch.tensor([[0, 0, 0, 1, 2, 3]], device=DEVICE)
    tokens = torch.tensor([[13, 2, 7, 4, 4, 9]], device=DEVICE)
    tree = Tree(parent, tokens, torch.tensor([[0, 1, 1, 2, 2, 3]], device=DEVICE), None)
    rows, seen = torch.tensor([0], device=DEVICE), ancestors(tree, 3)
    outputs = []
    for backend in (TritonBackend(), TorchBackend()):
        state = make_state(model, 2, 64)
        state.runner.backend = backend
        state.load_prompts(rows, [[5, 9, 13]])
        state.forward(rows, leave_last=True, last_only=True)
        logits, _ = state.forward_tree(rows, tree.tokens, tree.depth, seen)
        outputs.append(logits[0])
    assert (outputs[0] - outputs[1]).abs().max() <= 1e-4
    plain = make_state(model, 2, 64)
    plain.load_prompts(rows, [[5, 9, 13, 2, 4, 9]])  # the prompt, then the path of node 5 (tokens 2, 4, 9)
    path_logits = plain.forward(rows).logits[0]
    for node, column in ((0, 2), (1, 3), (3, 4), (5, 5)):  # the root sits at the prompt's last column
        assert (outputs[1][node] - path_logits[column]).abs().max() <= 1e-4, node


def test_backends_agree_on_the_device_steps_around_a_forward():
    """The Triton backend's row steps equal `TorchBackend`'s (the reference) on the same state: pending tokens and
    appended tokens, KV slots appended and rolled back, greedy draws, float64 log-sum-exps."""
    from hsmc.engine.kv_pool import BlockTables, SlotAllocator
    from hsmc.levels.base import TokenRows

    triton_backend, reference = TritonBackend(), TorchBackend()
    rows = torch.tensor([0, 2, 3])
    states = [TokenRows(4, 12, torch.device(DEVICE), b) for b in (triton_backend, reference)]
    tables = [BlockTables(SlotAllocator(40, DEVICE), 4, 12, b) for b in (triton_backend, reference)]
    for state, table in zip(states, tables):
        state.load_prompts(rows, [[1, 2, 3], [4], [5, 6, 7, 8, 9]])
        state.append(rows, torch.tensor([[10, 11], [12, 13], [14, 15]]))
        table.append(rows, torch.tensor([3, 1, 5]), 5)
        table.append(rows, torch.tensor([2, 2, 0]), 2)
        table.rollback(rows, torch.tensor([1, 0, 2]), 2)
        table.truncate(rows, torch.tensor([4, 1, 2]), 3)
    pending = [b.pending_tokens(s.seq, s.seq_len, t.length, rows, 1, 6) for b, s, t in
               zip((triton_backend, reference), states, tables)]  # fmt: skip
    for got, want in zip(*pending):
        assert torch.equal(got, want)
    assert torch.equal(states[0].seq, states[1].seq) and torch.equal(states[0].seq_len, states[1].seq_len)
    for name in ("table", "length"):
        assert torch.equal(getattr(tables[0], name), getattr(tables[1], name))
    assert torch.equal(tables[0].allocator.refcount, tables[1].allocator.refcount)
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    zero, none, keys = torch.zeros(5, device=DEVICE), torch.full((5,), -math.inf, device=DEVICE), torch.arange(5)
    greedy = [b.gumbel_max(logits, zero, none, keys.to(DEVICE)) for b in (triton_backend, reference)]
    assert torch.equal(greedy[0][0], greedy[1][0]) and torch.equal(greedy[0][1], greedy[1][1])
    scale, floor = torch.linspace(0.5, 2.0, 5, dtype=torch.float64, device=DEVICE), logits.median(-1).values
    lse = [b.logsumexp_rows(logits, scale, floor) for b in (triton_backend, reference)]
    assert lse[0].dtype == torch.float64 and (lse[0] - lse[1]).abs().max() < 1e-9


def test_eagle3_head_through_triton_keeps_its_hidden_input(tmp_path):
    """An EAGLE3 head step of more token rows than the few-row kernel takes (a GEMM whose o_proj adds into its
    residual in place) equals the reference and leaves the caller's `hidden` as it was."""
    shape = {
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": 80,
    }  # fmt: skip
    head, _ = random_eagle3_head(shape, "float32", DEVICE, draft_vocab_size=48)
    b, n = 2, 10  # 20 token rows
    torch.manual_seed(4)
    embeds, hidden = torch.randn(b, n, 32, device=DEVICE), torch.randn(b, n, 32, device=DEVICE)
    kept = hidden.clone()
    outs = []
    for backend in (TritonBackend(), TorchBackend()):
        cache = KVCache(1, (b + 1) * n, 2, 8, torch.float32, DEVICE)
        with torch.no_grad():
            outs.append(head(ttt_attention_batch(b, n, 0, 1, DEVICE), cache, backend, embeds=embeds, hidden=hidden))
        assert torch.equal(hidden, kept)
    for got, want in zip(*outs):
        assert (got - want).abs().max() <= 1e-4


def test_short_decode_attention_splits_only_while_programs_are_few():
    """On 132 SMs (H200) one decode row of an 8-KV-head model splits its context (measured faster), the 8 particles
    of an SMC proposal step (64 programs) do not at <= 512 keys (measured 3-5 % faster per 8B step), and past 512
    keys both split."""
    one, eight = (plan_attention(rows, 1, 512, 32, 8, 132) for rows in (1, 8))
    assert one.splits > 1 and (eight.splits, eight.block_n) == (1, 128)
    assert plan_attention(8, 1, 2048, 32, 8, 132).splits > 1


@pytest.mark.parametrize("leave, width", [(0, 1), (1, 3), (0, 5), (1, 0)])
def test_pending_tokens_and_token_append_match_the_reference(leave, width):
    """The one-kernel pending window and token append of CUDA (`hsmc.ops.token_rows`) against `TokenRows`'s
    torch ops: ragged rows, some with nothing pending, some past the capacity (clamped columns)."""
    from hsmc.levels.base import TokenRows
    from hsmc.ops.token_rows import append_tokens, pending_tokens

    g = torch.Generator().manual_seed(width * 2 + leave)
    rows_state = TokenRows(6, 12, torch.device("cpu"))
    rows_state.seq.copy_(torch.randint(0, 1000, rows_state.seq.shape, generator=g))
    rows_state.seq_len.copy_(torch.tensor([0, 3, 9, 12, 13, 5, 0]))
    kv_len = torch.tensor([0, 1, 9, 4, 13, 2, 0])
    rows = torch.tensor([5, 0, 3, 2, 4])
    start, count, tokens = pending_tokens(rows_state.seq, rows_state.seq_len, kv_len, rows, leave, width)
    want_start = kv_len[rows]
    want_count = (rows_state.seq_len[rows] - leave - want_start).clamp_min(0)
    assert torch.equal(start, want_start) and torch.equal(count, want_count)
    assert torch.equal(tokens, rows_state.window(rows, want_start, want_count, width))

    new = torch.randint(0, 1000, (len(rows), 3), generator=g)[:, :2]  # strided, as a draw's column may be
    reference = TokenRows(6, 12, torch.device("cpu"))
    reference.seq.copy_(rows_state.seq)
    reference.seq_len.copy_(rows_state.seq_len)
    reference.append(rows, new)
    append_tokens(rows_state.seq, rows_state.seq_len, rows, new)
    assert torch.equal(rows_state.seq, reference.seq) and torch.equal(rows_state.seq_len, reference.seq_len)
