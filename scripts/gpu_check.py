"""One-call GPU check for the engine's torch path: correctness vs the CPU oracle, and decode speed.

    python scripts/gpu_check.py [--new-tokens 128]

1. Tiny random Llama / Qwen2 / Qwen3 models: hsmc on CUDA (fp32, TF32 off) vs transformers on
   CPU, for a ragged batch through the KV pool; greedy generation on CUDA vs on CPU.
2. Qwen3-8B shape, random bf16 weights: batch-1 greedy decode tok/s of transformers `generate`
   vs hsmc's eager reference path, against the weight-bytes / copy-bandwidth roofline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_tiny_model  # noqa: E402
from helpers import hf_logits, make_runner, run_new_tokens  # noqa: E402

from hsmc.decoder import HierarchicalDecoder  # noqa: E402
from hsmc.levels.base import SequenceState  # noqa: E402
from hsmc.levels.model import ModelLevel  # noqa: E402
from hsmc.models.config import DecoderConfig  # noqa: E402
from hsmc.models.loading import build_model, load_model  # noqa: E402

QWEN3_8B = dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    eos_token_id=151645,
)


def check_tiny() -> None:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for arch in ("llama", "qwen2", "qwen3"):
        path = make_tiny_model(arch, Path(tempfile.mkdtemp()) / arch)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ours = load_model(str(path), device="cuda").model
        gen = torch.Generator().manual_seed(0)
        contexts = [torch.randint(0, 80, (n,), generator=gen).tolist() for n in (5, 1, 12, 3, 8, 2, 17, 6, 9)]
        new = [torch.randint(0, 80, (k,), generator=gen).tolist() for k in range(1, 10)]
        runner = make_runner(ours, device="cuda")
        run_new_tokens(runner, list(range(9)), contexts)
        got, _ = run_new_tokens(runner, list(range(9)), new)
        err = max(
            (got[i].cpu() - hf_logits(hf, contexts[i] + new[i])[len(contexts[i]) :]).abs().max().item()
            for i in range(9)
        )
        cfg = {"levels": [{"model": str(path)}], "engine": {"kv_capacity_tokens": 1024}}
        prompts = contexts[:4]
        cpu = HierarchicalDecoder.from_config(cfg).generate(prompts, max_new_tokens=24, ignore_eos=True)
        cfg["engine"]["device"] = "cuda"
        cuda = HierarchicalDecoder.from_config(cfg).generate(prompts, max_new_tokens=24, ignore_eos=True)
        same = all(a.token_ids == b.token_ids for a, b in zip(cpu, cuda))
        print(
            f"tiny {arch:6s}: ragged batch max|logit diff| CUDA vs transformers CPU {err:.2e}; "
            f"greedy CUDA == CPU: {same}"
        )


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - start)


def bench_8b(new_tokens: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**QWEN3_8B)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    ours = build_model(DecoderConfig.from_hf(hf_cfg), hf.state_dict(), torch.bfloat16, "cuda", "qwen3-8b-shape")
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    bw = copy_bandwidth()
    prompt = torch.randint(0, 150000, (1, 32), device="cuda")

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return new_tokens / (time.perf_counter() - start)

    def run_hf() -> None:
        with torch.no_grad():
            hf.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    level = ModelLevel(SequenceState(ours, 1, 4096, torch.device("cuda")), 0.0, torch.Generator("cuda"))
    row = torch.zeros(1, dtype=torch.int64, device="cuda")

    def run_ours() -> None:
        level.load_prompts(row, [prompt[0].tolist()])
        level.prefill(row)
        for _ in range(new_tokens):
            level.propose(row, 1)
        level.release(row)

    hf_tps, ours_tps = timed(run_hf), timed(run_ours)
    roof = bw / weight_bytes
    print(f"device: {torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s; weights {weight_bytes / 1e9:.1f} GB")
    print(f"Qwen3-8B shape bf16, batch 1, {new_tokens} new tokens:")
    print(f"{'':28s}{'tok/s':>8}{'vs transformers':>17}{'of roofline':>13}")
    print(f"{'roofline (bytes/bandwidth)':28s}{roof:>8.1f}{'':>17}{1:>12.0%}")
    print(f"{'transformers generate':28s}{hf_tps:>8.1f}{1:>16.2f}x{hf_tps / roof:>12.0%}")
    print(f"{'hsmc eager (torch ref)':28s}{ours_tps:>8.1f}{ours_tps / hf_tps:>16.2f}x{ours_tps / roof:>12.0%}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    check_tiny()
    bench_8b(args.new_tokens)
