"""The Triton kernels compiled on the GPU against the torch reference, at the sizes the interpreter cannot reach
(tests/test_triton_kernels.py runs the same comparisons interpreted on tiny shapes): paged attention over ragged
batches with contexts up to 8k keys, the fused kernels and the one-row and few-row Linears on the Qwen3-8B's shapes in
bf16, and the KV-slot bookkeeping over a pool of many chunks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.ops.backend import HeadLayout, Rope, TorchBackend, rms_norm_reference
from hsmc.ops.batch import ForwardBatch, padded_columns
from hsmc.ops.kv_cache import KVCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16_EPS = torch.finfo(torch.bfloat16).eps


def ragged_batch(rng: random.Random, rows: int, tokens: int, max_context: int, slots: int) -> ForwardBatch:
    """Rows of 1..tokens new tokens after 0..max_context - tokens keys over a shuffled block table; row 0 is the
    longest (all `tokens` new tokens at the full context)."""
    start = torch.tensor([rng.randint(0, max_context - tokens) for _ in range(rows)], device="cuda")
    start[0] = max_context - tokens
    num_new = torch.tensor([rng.randint(1, tokens) for _ in range(rows)], device="cuda")
    num_new[0] = tokens
    table = torch.randperm(slots, device="cuda")[: (rows + 1) * (max_context + 1)].view(rows + 1, -1)
    row_ids = torch.arange(rows, device="cuda")
    cols = padded_columns(start, num_new, tokens)
    valid = torch.arange(tokens, device="cuda")[None] < num_new[:, None]
    write = torch.where(valid, table[row_ids[:, None], cols], slots)
    zeros = torch.zeros(rows, tokens, dtype=torch.int64, device="cuda")
    return ForwardBatch(row_ids, table, zeros, cols, write, start, num_new, int((start + num_new).max()))


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest distance in bf16 units in the last place at the value's scale (at least 1)."""
    return ((got.float() - want.float()).abs() / (want.float().abs().clamp_min(1) * BF16_EPS)).max().item()


# Both sides accumulate in fp32; the kernel rounds the softmax weights to the input dtype before the PV product (as
# flash attention does) and sums in another order, so outputs of magnitude ~1 differ by a few units of the dtype's
# last place (measured on an H200: bf16 3.9e-3, fp32 1.4e-6); a wrong mask, split or table lookup is off by O(1).
ATTENTION_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}
ATTENTION_CASES = [  # rows, new tokens per row (1: decode, 9: an SMC verify, more: prefill chunks), keys, heads
    (1, 1, 8192, 32, 8),
    (4, 1, 3000, 64, 8),
    (16, 1, 700, 32, 8),
    (16, 9, 2048, 64, 8),
    (128, 9, 268, 64, 8),  # 16 requests' particles: the many-programs plans
    (128, 1, 272, 32, 8),
    (3, 5, 8192, 32, 8),
    (2, 128, 1024, 32, 8),
    (5, 17, 200, 16, 8),
    (2, 1, 1, 32, 8),
]


@pytest.mark.parametrize("dtype", list(ATTENTION_TOLERANCE), ids=str)
@pytest.mark.parametrize("rows, tokens, context, heads, kv_heads", ATTENTION_CASES)
def test_paged_attention_matches_the_reference(dtype, rows, tokens, context, heads, kv_heads):
    from hsmc.ops.paged_attention import paged_attention, plan_attention

    rng = random.Random(rows * 1000 + context)
    slots = (rows + 1) * (context + 1) + 7
    batch = ragged_batch(rng, rows, tokens, context, slots)
    cache = KVCache(1, slots, kv_heads, 128, dtype, "cuda")
    cache.data.normal_()
    q = torch.randn(rows, tokens, heads, 128, dtype=dtype, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_attention(rows, tokens, batch.max_context, heads, kv_heads, sms)
    out = paged_attention(q, cache.keys(0), cache.values(0), batch.table, batch.rows, batch.start, batch.num_new, plan)
    meta = TorchBackend().prepare(batch, Rope(torch.ones(64, device="cuda"), 1.0), dtype)
    ref = TorchBackend().attend(0, q, cache, batch, meta).view(q.shape)
    for i, n in enumerate(batch.num_new.tolist()):
        assert (out[i, :n] - ref[i, :n]).abs().max().item() <= ATTENTION_TOLERANCE[dtype], (i, plan)


def particle_batch(rng: random.Random, rows: int, run: int, tokens: int, prompt: int, slots: int) -> ForwardBatch:
    """SMC particles: runs of `run` rows that share a prompt of up to `prompt` columns (whole in the first run), then
    0..64 columns of their own; the last row is padding (no new tokens)."""
    perm = torch.randperm(slots).tolist()
    width = prompt + 64 + tokens
    table = torch.full((rows + 1, width + 1), slots - 1)
    start = []
    for i in range(rows):
        if i % run == 0:
            shared = [perm.pop() for _ in range(prompt if i == 0 else rng.randint(0, prompt))]
        own = rng.randint(0, 64)
        columns = shared + [perm.pop() for _ in range(own + tokens)]
        table[i, : len(columns)] = torch.tensor(columns)
        start.append(len(shared) + own)
    start_t, table = torch.tensor(start, device="cuda"), table.cuda()
    num_new = torch.tensor([rng.randint(1, tokens) for _ in range(rows)], device="cuda")
    num_new[-1] = 0
    row_ids = torch.arange(rows, device="cuda")
    cols = padded_columns(start_t, num_new, tokens)
    valid = torch.arange(tokens, device="cuda")[None] < num_new[:, None]
    write = torch.where(valid, table[row_ids[:, None], cols], slots - 1)
    zeros = torch.zeros(rows, tokens, dtype=torch.int64, device="cuda")
    return ForwardBatch(row_ids, table, zeros, cols, write, start_t, num_new, int((start_t + num_new).max()))


@pytest.mark.parametrize("dtype", list(ATTENTION_TOLERANCE), ids=str)
@pytest.mark.parametrize(
    "rows, run, tokens, prompt, heads",
    [(128, 8, 1, 256, 32), (128, 8, 9, 256, 64), (8, 8, 1, 4000, 32), (20, 8, 9, 2048, 64), (12, 4, 3, 600, 16)],
)
def test_particles_reading_their_shared_prefix_once_match_the_reference(dtype, rows, run, tokens, prompt, heads):
    """Cascade attention over SMC-shaped batches (a 16-request cycle of the 8B and 32B, one request with a long
    prompt, runs cut by the batch's end): the planned shared-prefix pass and the rows' own columns after it."""
    from hsmc.ops.paged_attention import paged_attention, plan_attention, shared_columns

    rng = random.Random(rows * 100 + prompt)
    slots = rows * (prompt + 64 + tokens) + 7
    batch = particle_batch(rng, rows, run, tokens, prompt, slots)
    shared = shared_columns(batch.table, batch.rows, batch.start, batch.num_new, run)
    assert shared[0, 0].item() == prompt  # the first run shares its whole prompt
    cache = KVCache(1, slots, 8, 128, dtype, "cuda")
    cache.data.normal_()
    q = torch.randn(rows, batch.tokens.shape[1], heads, 128, dtype=dtype, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_attention(rows, tokens, batch.max_context, heads, 8, sms, run=run)
    args = (q, cache.keys(0), cache.values(0), batch.table, batch.rows, batch.start, batch.num_new, plan)
    out = paged_attention(*args, None, shared)
    meta = TorchBackend().prepare(batch, Rope(torch.ones(64, device="cuda"), 1.0), dtype)
    ref = TorchBackend().attend(0, q, cache, batch, meta).view(q.shape)
    for i, n in enumerate(batch.num_new.tolist()):
        if n:
            assert (out[i, :n] - ref[i, :n]).abs().max().item() <= ATTENTION_TOLERANCE[dtype], (i, plan)


@pytest.mark.parametrize("plan", [(1, 1), (8, 4), (16, 8)], ids=["head", "8-heads", "16-heads"])
def test_fused_norm_silu_rope_and_kv_write_within_one_rounding(plan, monkeypatch):
    """Each fused kernel computes in fp32 and rounds to bf16 once; the reference rounds the same fp32 values,
    reduced in another order (and the norm and RoPE in two steps), so the two differ by a rounding flip or two
    (measured on an H200: 0 ulp for the norm and SiLU, 1.5 for the q norm + RoPE, 1 for the KV written). The q/k
    norm + RoPE + KV write runs over a ragged verify-shaped batch, at each grouping of heads in a program."""
    from hsmc.ops import fused
    from hsmc.ops.triton_backend import TritonBackend

    monkeypatch.setattr(fused, "qkv_rope_plan", lambda tokens: plan)

    torch.manual_seed(0)
    x = torch.randn(64, 5120, device="cuda", dtype=torch.bfloat16) * 4
    res = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(5120, device="cuda")).to(torch.bfloat16)
    assert ulps(fused.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)) <= 1
    assert ulps(fused.silu_mul(torch.cat([x, res], -1)), F.silu(x) * res) <= 1
    batch = ragged_batch(random.Random(1), 4, 9, 300, 2000)
    qkv = torch.randn(4, 9, 48 * 128, device="cuda", dtype=torch.bfloat16)
    rope = Rope(1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128)), 1.0)
    outs = []
    for backend in (TritonBackend(), TorchBackend()):
        cache = KVCache(1, 2000, 8, 128, torch.bfloat16, "cuda")
        meta = backend.prepare(batch, rope, torch.bfloat16)
        q = backend.qkv_to_cache(0, qkv, HeadLayout(32, 8, 128), (w[:128], w[128:256], 1e-6), cache, batch, meta)
        outs.append((q, cache.data[:, :, :2000]))
    valid = torch.arange(9, device="cuda")[None] < batch.num_new[:, None]
    assert ulps(outs[0][0][valid], outs[1][0][valid]) <= 2
    assert ulps(outs[0][1], outs[1][1]) <= 2


@pytest.mark.parametrize("step", ["qkv+norm", "o+residual", "down+silu+residual"])
@pytest.mark.parametrize("rows", [1, 2, 8, 16])
def test_backend_linears_on_the_8b_shapes_match_the_reference(step, rows):
    """The Triton backend's Linear steps (one row: the one-row kernels with their fused norm / SiLU prologue and
    residual epilogue; 2..16 rows: the few-row kernels) against `TorchBackend`'s in bf16. Both accumulate in fp32
    and round once (the residual added before or after that rounding), so every output is within 2 bf16 ulps of
    the reference (measured <= 1.55) and nearly all are bit-equal (measured >= 99.8 % for the few-row kernels; the
    one-row kernels' norm, fused, skips the bf16 rounding of its output: relative error 2e-4, a fraction of a
    percent of outputs one rounding away). A wrong tile, split or prologue is off everywhere."""
    from hsmc.ops.triton_backend import TritonBackend

    n, k = {"qkv+norm": (6144, 4096), "o+residual": (4096, 4096), "down+silu+residual": (4096, 12288)}[step]
    torch.manual_seed(rows)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    norm = torch.nn.Module()
    norm.weight, norm.eps = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16), 1e-6
    x = torch.randn(1, rows, 2 * k if step.startswith("down") else k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, rows, n, device="cuda", dtype=torch.bfloat16)
    got, want = (
        b.norm_linear(x, norm, linear) if step == "qkv+norm" else
        b.linear(x, linear, residual.clone()) if step == "o+residual" else b.silu_linear(x, linear, residual.clone())
        for b in (TritonBackend(), TorchBackend())
    )  # fmt: skip
    assert ulps(got, want) <= 2
    assert (got == want).float().mean().item() >= 0.95


def test_slot_bookkeeping_over_a_pool_of_many_chunks():
    """KV slots appended, rolled back and truncated by the Triton kernels (`hsmc.ops.kv_slots`) give the reference's
    tables, lengths and refcounts over a pool large enough that the appending program walks many chunks, with some
    slots already taken by other rows (the free ones are scattered)."""
    from hsmc.ops.triton_backend import TritonBackend

    rng = torch.Generator().manual_seed(3)
    tables = [BlockTables(SlotAllocator(600_000, "cuda"), 48, 4096, b) for b in (TritonBackend(), TorchBackend())]
    rows = torch.randperm(48, generator=rng)[:40].cuda()
    for _ in range(6):
        counts = torch.randint(0, 300, (40,), generator=rng).cuda()
        back = torch.randint(0, 40, (40,), generator=rng).cuda()
        cut = torch.randint(0, 2000, (40,), generator=rng).cuda()
        outs = []
        for table in tables:
            slots, start, cols = table.append(rows, counts, 300)
            table.rollback(rows, torch.minimum(back, table.length[rows]), 40)
            table.truncate(rows[:8], cut[:8], 2000)
            outs.append((slots, start, cols))
        for got, want in zip(*outs):
            assert torch.equal(got, want)
        rows = rows[torch.randperm(40, generator=rng).cuda()]
    for name in ("table", "length"):
        assert torch.equal(getattr(tables[0], name), getattr(tables[1], name))
    assert torch.equal(tables[0].allocator.refcount, tables[1].allocator.refcount)


@pytest.mark.parametrize("rule", ["target_only", "draft_aware", "traversal"])
def test_tree_walk_over_the_qwen3_vocabulary_matches_the_reference(rule):
    """The tree walk's kernels (`hsmc.ops.tree_walk`) against the torch walks on 4 rows of a 33-node tree (root with
    6 children, each node with up to 6) over 151,936 tokens: the same stopping node and residual law."""
    from hsmc.ops.tree_walk import tree_walk
    from hsmc.speculative.tree_verify import verify_tree, verify_tree_traversal

    rows, n, vocab, topk = 4, 33, 151_936, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    parent = torch.tensor([0] + [(i - 1) // topk for i in range(1, n)], device="cuda").expand(rows, -1).contiguous()
    q = (3 * torch.randn(rows, n, vocab, device="cuda", generator=g)).softmax(-1)
    p = (0.5 * q.log() + 2 * torch.randn(rows, n, vocab, device="cuda", generator=g)).softmax(-1)
    # children drawn without replacement from their parent's q (Gumbel-top-k)
    noise = -torch.log(-torch.log(torch.rand(rows, n, vocab, device="cuda", generator=g).clamp_min(1e-12)))
    drawn = (q.log() + noise).topk(topk, -1).indices  # [R, N, topk]
    rank = torch.tensor([0] + [(i - 1) % topk for i in range(1, n)], device="cuda")
    tokens = drawn[torch.arange(rows, device="cuda")[:, None], parent, rank.expand(rows, -1)]
    u = torch.rand(rows, n, device="cuda", generator=g)
    drafter = None if rule == "target_only" else q
    want = (verify_tree_traversal if rule == "traversal" else verify_tree)(parent, tokens, p, drafter, u)
    node, residual = tree_walk(rule, parent, tokens, p, drafter, u, max_children=topk)
    assert node.tolist() == want[0].tolist()
    torch.testing.assert_close(residual, want[1], atol=1e-7, rtol=1e-4)
