"""`hsmc bench`: decode speed against the memory-bandwidth roofline, with transformers as the baseline.

    hsmc bench --shape qwen3-8b --batch 1,4,16 --new-tokens 256      # random weights of a real shape
    hsmc bench --config configs/demo.yaml --batch 1,4                 # a config's stack as configured
    hsmc bench --shape qwen3-32b --dtype fp8 --batch 1                # FP8 weights, and bf16 in the same run

Each row of the table is one batch size: the same random token-id prompts go through hsmc and through
transformers' eager `generate` on the *same* weights (its modules alias hsmc's tensors, so the pair
fits where one model fits). Decode speed is measured as the difference between a run of N new tokens
and a run of 1 (prefill and first token cancel out); the roofline is batch x copy bandwidth / weight
bytes, since a decode step must read every weight once. With `--dtype fp8` every shape runs twice, with
block-scaled FP8 weights (the roofline counts their bytes, scales included) and then with bf16 weights,
and the FP8 rows carry their speed-up over bf16 (transformers runs beside the bf16 rows only: it has no
twin on hsmc's FP8 tensors). Numbers, not pass/fail: this is not a test.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hsmc.config import HsmcConfig, load_config
from hsmc.models.config import DecoderConfig
from hsmc.models.decoder import DecoderLM
from hsmc.models.loading import COMPUTE_DTYPES, LoadedModel
from hsmc.models.shapes import SHAPES, hf_config, random_model, weight_bytes


@dataclass
class BenchRow:
    name: str
    batch: int
    new_tokens: int
    hsmc_tok_s: float  # decode tokens/s over all rows
    hsmc_e2e_tok_s: float  # including prefill
    baseline_tok_s: float | None  # transformers eager generate, decode only
    roofline_tok_s: float
    levels: list[dict[str, Any]]
    vs_bf16: float | None = None  # an fp8 row: its tok/s over the bf16 row of the same shape and batch

    @property
    def of_roofline(self) -> float:
        return self.hsmc_tok_s / self.roofline_tok_s

    @property
    def vs_baseline(self) -> float | None:
        return self.hsmc_tok_s / self.baseline_tok_s if self.baseline_tok_s else None


def copy_bandwidth(device: torch.device, gigabytes: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the best of five
    timed windows after a warm-up long enough to bring the clocks up, so the roofline is not set low."""
    x = torch.empty(int(gigabytes * 2**30), dtype=torch.uint8, device=device)
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(30):
        y.copy_(x)
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        torch.cuda.synchronize(device)
        best = max(best, 2 * x.numel() * 10 / (time.perf_counter() - start))
    return best


def hf_twin(model: DecoderLM, hf_cfg: Any) -> Any:
    """transformers' own model whose parameters alias `model`'s tensors (no second copy of the weights)."""
    from transformers import AutoModelForCausalLM

    device = model.lm_head.weight.device
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=model.dtype)
    hf.load_state_dict(model.state_dict(), strict=False, assign=True)
    rotary = hf.model.rotary_emb  # its inv_freq buffer is not in a state dict: rebuild it on the device
    with torch.device(device):
        hf.model.rotary_emb = type(rotary)(config=hf.config).to(device)
    if hf_cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    return hf.eval()


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_decoder(
    name: str,
    decoder: Any,
    top: DecoderLM,
    hf: Any | None,
    batches: list[int],
    prompt_tokens: int,
    new_tokens: int,
    bandwidth: float,
    seed: int = 0,
) -> list[BenchRow]:
    """Time hsmc and (when given) transformers on the same prompts for every batch size."""
    rows = []
    vocab = top.config.vocab_size
    roof = bandwidth / weight_bytes(top)
    for b in batches:
        g = torch.Generator().manual_seed(seed + b)
        prompts = torch.randint(0, vocab, (b, prompt_tokens), generator=g)
        ids = prompts.tolist()

        def run(n: int) -> list:
            return decoder.generate(ids, max_new_tokens=n, ignore_eos=True)

        run(min(new_tokens, 16))  # warm-up: kernels compiled, graphs captured
        t_one = timed(lambda: run(1))
        results: list = []
        t_all = timed(lambda: results.extend(run(new_tokens)))
        decode = b * (new_tokens - 1) / max(t_all - t_one, 1e-9)
        baseline = None
        if hf is not None:
            inputs = prompts.to(top.lm_head.weight.device)

            def run_hf(n: int) -> None:
                with torch.no_grad():
                    hf.generate(inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)

            run_hf(4)
            hf_one = timed(lambda: run_hf(1))
            hf_all = timed(lambda: run_hf(new_tokens))
            baseline = b * (new_tokens - 1) / max(hf_all - hf_one, 1e-9)
        levels = results[0].stats["levels"]
        rows.append(BenchRow(name, b, new_tokens, decode, b * new_tokens / t_all, baseline, b * roof, levels))
    return rows


def shape_case(
    shape: str, dtype: str, device: torch.device, engine: dict[str, Any]
) -> tuple[Any, DecoderLM, Any | None]:
    """A one-level decoder over random weights of a named shape, and its transformers twin (None for fp8)."""
    from hsmc.decoder import HierarchicalDecoder

    hf_cfg = hf_config(shape)
    cfg = DecoderConfig.from_hf(hf_cfg, source=shape)
    fp8 = dtype == "fp8"
    model = random_model(cfg, COMPUTE_DTYPES[dtype], device, fp8=fp8)
    config = load_config({"levels": [{"model": shape, "dtype": dtype}], "engine": {"device": str(device), **engine}})
    decoder = HierarchicalDecoder(config, models={shape: LoadedModel(model, None, shape)})
    return decoder, model, None if fp8 else hf_twin(model, hf_cfg)


def config_case(config: HsmcConfig) -> tuple[Any, DecoderLM]:
    from hsmc.decoder import HierarchicalDecoder

    decoder = HierarchicalDecoder(config)
    return decoder, decoder.stack.top.state.runner.module


def format_table(rows: list[BenchRow], device_name: str, bandwidth: float) -> str:
    lines = [
        f"device: {device_name}; measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)",
        f"{'case':<20}{'batch':>6}{'roofline':>10}{'hsmc':>9}{'of roof':>9}{'transformers':>14}{'hsmc/tf':>9}"
        f"{'hsmc e2e':>10}{'vs bf16':>9}",
    ]
    for r in rows:
        base = f"{r.baseline_tok_s:>14.1f}" if r.baseline_tok_s else f"{'-':>14}"
        ratio = f"{r.vs_baseline:>8.2f}x" if r.vs_baseline else f"{'-':>9}"
        vs_bf16 = f"{r.vs_bf16:>8.2f}x" if r.vs_bf16 else f"{'-':>9}"
        lines.append(
            f"{r.name:<20}{r.batch:>6}{r.roofline_tok_s:>10.1f}{r.hsmc_tok_s:>9.1f}{r.of_roofline:>8.1%}"
            f"{base}{ratio}{r.hsmc_e2e_tok_s:>10.1f}{vs_bf16}"
        )
    lines.append("tok/s summed over the batch; decode only (N-token run minus 1-token run) except 'hsmc e2e'")
    return "\n".join(lines)


def plot(rows: list[BenchRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r.name for r in rows):
        mine = [r for r in rows if r.name == name]
        batches = [r.batch for r in mine]
        ax.plot(batches, [r.hsmc_tok_s for r in mine], "o-", label=f"{name} hsmc")
        ax.plot(batches, [r.roofline_tok_s for r in mine], "k--", label=f"{name} roofline")
        if all(r.baseline_tok_s for r in mine):
            ax.plot(batches, [r.baseline_tok_s for r in mine], "s:", label=f"{name} transformers")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (rows decoded together)")
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_bench(
    shapes: list[str],
    config: HsmcConfig | None,
    batches: list[int],
    prompt_tokens: int,
    new_tokens: int,
    dtype: str,
    baseline: bool,
    engine: dict[str, Any],
) -> tuple[list[BenchRow], str]:
    """Benchmark every named shape (or the config's stack); returns the rows and the printed table."""
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows: list[BenchRow] = []
    for shape in shapes:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        by_dtype: dict[str, list[BenchRow]] = {}
        for case_dtype in ("fp8", "bfloat16") if dtype == "fp8" else (dtype,):
            decoder, model, hf = shape_case(shape, case_dtype, device, engine)
            name = f"{shape} {case_dtype}" if dtype == "fp8" else shape
            by_dtype[case_dtype] = bench_decoder(
                name, decoder, model, hf if baseline else None, batches, prompt_tokens, new_tokens, bandwidth
            )
            del decoder, model, hf
            gc.collect()  # runners and their CUDA graphs reference each other: free them before the next case
            torch.cuda.empty_cache()
        if dtype == "fp8":
            for fp8_row, bf16_row in zip(by_dtype["fp8"], by_dtype["bfloat16"]):
                fp8_row.vs_bf16 = fp8_row.hsmc_tok_s / bf16_row.hsmc_tok_s
        rows += [r for case in by_dtype.values() for r in case]
    if config is not None:
        decoder, top = config_case(config)
        rows += bench_decoder("config", decoder, top, None, batches, prompt_tokens, new_tokens, bandwidth)
    return rows, format_table(rows, torch.cuda.get_device_name(device), bandwidth)


def to_json(rows: list[BenchRow]) -> str:
    return json.dumps([{**asdict(r), "of_roofline": r.of_roofline, "vs_baseline": r.vs_baseline} for r in rows])
