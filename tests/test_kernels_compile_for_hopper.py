"""Kernels the CPU suite runs through Triton's interpreter, compiled for an H100/H200 (sm_90, with the ptxas that
Triton ships): the interpreter accepts code the compiler rejects (a module global not declared `tl.constexpr`
passed every interpreted test of a kernel and failed all of its GPU tests, 2026-11-30). The public wrappers run
on tiny inputs with each launch recorded (argument types, constexprs, launch options); a fresh interpreter without
TRITON_INTERPRET then compiles every kernel at those signatures, so this fails where the GPU would fail to build."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import make_tiny_model

triton = pytest.importorskip("triton")

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("checks kernels that run interpreted (the CPU suite)", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from hsmc.decoder import HierarchicalDecoder  # noqa: E402
from hsmc.ops import vocab  # noqa: E402
from hsmc.ops.decode_linear import decode_linear  # noqa: E402
from hsmc.ops.few_row_linear import few_row_linear  # noqa: E402
from hsmc.ops.fp8_gemm import (  # noqa: E402
    dequantize_fp8_triton,
    fp8_gemm,
    quantize_groups,
    rms_norm_quantize,
    silu_mul_quantize,
    w8a8_matmul,
)
from hsmc.ops.fp8_linear import quantize_fp8  # noqa: E402
from hsmc.ops.paged_attention import paged_attention, plan_attention, shared_columns  # noqa: E402
from hsmc.ops.push_all_reduce import BITS, FREE, SLOTS, PushAllReduce  # noqa: E402
from hsmc.ops.tree_walk import tree_walk  # noqa: E402

POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float64: "*fp64",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int16: "*i16",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
    torch.float8_e4m3fn: "*fp8e4nv",
}
OPTIONS = ("num_warps", "num_stages")  # launch options that change the compiled code

COMPILE = """
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
failed = []
for launch in json.loads(sys.stdin.read()):
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    for name, value in launch["constexprs"].items():
        if isinstance(value, dict):  # a Triton dtype
            launch["constexprs"][name] = triton.language.dtype(value["tl_dtype"])
    source = ASTSource(kernel, signature=launch["signature"], constexprs=launch["constexprs"])
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as error:
        failed.append(f"{launch['module']}.{launch['kernel']}: {type(error).__name__}: {str(error)[:2000]}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _recorded(monkeypatch: pytest.MonkeyPatch, run) -> list[dict]:
    """The distinct launches `run()` makes: module, kernel, signature, constexprs and options of each."""
    launches: dict[str, dict] = {}
    original = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        names = self.arg_names
        values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        signature, constexprs = {}, {}
        for name in names:
            value = values[name]
            if "constexpr" in str(self.fn.__annotations__.get(name, "")) or value is None:
                signature[name] = "constexpr"
                constexprs[name] = {"tl_dtype": str(value)} if isinstance(value, tl.dtype) else value
            elif isinstance(value, torch.Tensor):
                signature[name] = POINTER_TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            else:
                signature[name] = "fp32"
        launch = {
            "module": self.fn.__module__,
            "kernel": self.fn.__name__,
            "signature": signature,
            "constexprs": constexprs,
            "options": {k: v for k, v in kwargs.items() if k in OPTIONS},
        }
        launches[json.dumps(launch, sort_keys=True)] = launch
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    run()
    monkeypatch.setattr(InterpretedFunction, "run", original)
    return list(launches.values())


def _compile_for_hopper(launches: list[dict]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", COMPILE], input=json.dumps(launches), env=env, capture_output=True, text=True
    )


def _vocabulary_passes() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 40, generator=g)
    scale, floor = torch.tensor([1.0, 0.0]), torch.full((2,), float("-inf"))
    vocab.gumbel_max(logits, scale, floor, torch.tensor([1, 2]))
    vocab.logsumexp_rows(logits, scale.double(), floor)
    vocab.gumbel_top_k(torch.log_softmax(logits, -1), torch.tensor([1, 2]), 3)


def _tree_walks() -> None:
    g = torch.Generator().manual_seed(0)
    parent = torch.tensor([[0, 0, 0, 1, 1, 2]])
    tokens = torch.tensor([[3, 1, 4, 2, 5, 0]])
    p, q = torch.rand(2, 1, 6, 7, generator=g).softmax(-1)
    u = torch.rand(1, 6, generator=g)
    for rule in ("target_only", "draft_aware", "traversal"):
        tree_walk(rule, parent, tokens, p, None if rule == "target_only" else q, u, max_children=3)


def _linears() -> None:
    """The Linears' kernels with every prologue and epilogue: one row and few rows (norm-fed, SiLU·mul-fed, with a
    residual), FP8 weights alone (one row, and the GEMM), FP8 activations (the quantizers and the w8a8 GEMM)."""
    g = torch.Generator().manual_seed(0)
    x, gate_up, w = torch.randn(3, 1, 64, generator=g), torch.randn(3, 1, 128, generator=g), torch.randn(40, 64)
    norm, residual = (torch.rand(64, generator=g) + 0.5, 1e-6), torch.randn(3, 1, 40, generator=g)
    for rows, linear in ((1, decode_linear), (3, few_row_linear)):
        linear(x[:rows], w, norm=norm, residual=residual[:rows])
        linear(gate_up[:rows], w, silu_mul=True, bias=torch.randn(40, generator=g))
    block = (128, 128)
    weight, scale = quantize_fp8(torch.randn(40, 256, generator=g), block)
    decode_linear(torch.randn(1, 1, 256, generator=g), weight, scale=scale, scale_block=block)
    fp8_gemm(torch.randn(3, 256, generator=g), weight, scale, block)
    q, q_scale = rms_norm_quantize(torch.randn(3, 256, generator=g), torch.rand(256, generator=g) + 0.5, 1e-6, 128)
    w8a8_matmul(q, q_scale, weight, scale, block, torch.float32)
    silu_mul_quantize(torch.randn(3, 512, generator=g), 128)
    quantize_groups(torch.randn(3, 256, generator=g), 128)
    dequantize_fp8_triton(weight, scale, block, torch.float32)


def _attention_and_all_reduce() -> None:
    """A decode row's attention split over its context (the combine kernel), verify rows in whole-row tiles of 128
    queries, a run of rows reading their shared prefix once (16- and 32-bit), and the push all-reduce as rank 0 of
    two (the peer's buffer simulated, as tests/test_push_all_reduce.py does)."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 64, 2, 16, generator=g)
    plan = plan_attention(1, 1, 41, 4, 2, 4)
    start, one = torch.tensor([40]), torch.tensor([1])
    q = torch.randn(1, 1, 4, 16, generator=g)
    paged_attention(
        q, keys, values, torch.arange(64)[None], torch.tensor([0]), start, one, dataclasses.replace(plan, splits=4)
    )
    for dtype in (torch.float16, torch.float32):  # verify rows on a GPU of few SMs: the many-programs plan (a
        # 9-token row's 72 queries in one 128-query tile over 32-key blocks)
        q9 = torch.randn(2, 9, 16, 16, generator=g).to(dtype)
        nine, starts = torch.tensor([9, 9]), torch.tensor([30, 40])
        many = plan_attention(2, 9, 49, 16, 2, 1)
        assert (many.block_m, many.block_n) == (128, 32)
        paged_attention(q9, keys.to(dtype), values.to(dtype), torch.arange(64).expand(2, 64), torch.arange(2),
                        starts, nine, many)  # fmt: skip
    for dtype in (torch.float16, torch.float32):  # a run of 4 particles over one prompt's columns, then their own
        table = torch.cat([torch.arange(30).expand(4, 30), 30 + torch.arange(4 * 10).view(4, 10)], 1)
        rows, starts = torch.arange(4), torch.tensor([35, 33, 39, 31])
        shared = shared_columns(table, rows, starts, torch.ones(4, dtype=torch.int64), 4)
        run_plan = plan_attention(4, 1, 40, 4, 2, 4, run=4)
        keys16, values16, q4 = keys.to(dtype), values.to(dtype), torch.randn(4, 1, 4, 16, generator=g).to(dtype)
        paged_attention(
            q4, keys16, values16, table, rows, starts, torch.ones(4, dtype=torch.int64), run_plan, None, shared
        )
    for dtype in (torch.bfloat16, torch.float32):
        mine = torch.full((SLOTS, 2, 256), FREE[dtype], dtype=BITS[dtype])
        peer = torch.full_like(mine, FREE[dtype])
        mine[0, 1] = 0  # the peer's push (zeros), arrived before rank 0 looks
        PushAllReduce(mine, [mine.data_ptr(), peer.data_ptr()], rank=0, dtype=dtype)(torch.randn(256).to(dtype))


def _stack_through_triton(folder, **top) -> None:
    """A sampled rejection stack on the Triton backend: the forwards' kernels (Linears, fused norms, qkv/RoPE/KV
    store, paged attention), token rows, KV slots, stream keys and draws; with a tree in `top`, tree-masked
    attention and the tree walk."""
    small, big = make_tiny_model("qwen3", folder / "s", seed=3), make_tiny_model("qwen3", folder / "b", seed=4)
    levels = [
        {"model": str(small), "temperature": 1.0},
        {"kind": "rejection", "model": str(big), "num_draft_tokens": 2, "temperature": 1.0, **top},
    ]
    decoder = HierarchicalDecoder.from_config({"levels": levels, "engine": {"device": "cpu", "attention": "triton"}})
    decoder.generate([[5, 9, 13], [7, 7]], max_new_tokens=3, seed=0)


@pytest.mark.parametrize("run", ["vocab", "tree_walk", "linears", "attention_all_reduce", "stack", "tree_stack"])
def test_interpreted_kernels_compile_for_sm90(monkeypatch, tmp_path, run):
    cases = {
        "vocab": _vocabulary_passes,
        "tree_walk": _tree_walks,
        "linears": _linears,
        "attention_all_reduce": _attention_and_all_reduce,
        "stack": lambda: _stack_through_triton(tmp_path),
        "tree_stack": lambda: _stack_through_triton(
            tmp_path, tree={"depth": 2, "topk": 2, "budget": 3}, tree_rule="traversal"
        ),
    }
    launches = _recorded(monkeypatch, cases[run])
    assert launches, "no kernel launched: nothing was checked"
    result = _compile_for_hopper(launches)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_fails_on_a_global_the_compiler_rejects(monkeypatch, tmp_path):
    """The check has teeth: a kernel reading a plain module float (interpreted, it runs) does not compile."""
    module = tmp_path / "plain_global_kernel.py"
    module.write_text(
        "import triton\nimport triton.language as tl\n\nLOWEST = -3.0e38\n\n\n@triton.jit\n"
        "def kernel(x_ptr, BLOCK: tl.constexpr):\n"
        "    i = tl.arange(0, BLOCK)\n    tl.store(x_ptr + i, tl.maximum(tl.load(x_ptr + i), LOWEST))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import plain_global_kernel

    x = torch.zeros(8)
    launches = _recorded(monkeypatch, lambda: plain_global_kernel.kernel[(1,)](x, BLOCK=8))
    assert torch.equal(x, torch.zeros(8))  # the interpreter ran it
    result = _compile_for_hopper(launches)
    assert result.returncode == 1 and "LOWEST" in result.stdout
