"""`hsmc bench`: decode speed against the memory-bandwidth roofline, with transformers as the baseline.

    hsmc bench --shape qwen3-8b --batch 1,4,16 --new-tokens 256      # random weights of a real shape
    hsmc bench --config configs/bench/smc_8b_32b.yaml --batch 1,4,16  # a config's stack as configured
    hsmc bench --shape qwen3-32b --dtype fp8 --batch 1                # FP8 weights, and bf16 in the same run

For a shape, each row of the table is one batch size: the same random token-id prompts go through hsmc
and through transformers' eager `generate` on the *same* weights (its modules alias hsmc's tensors, so
the pair fits where one model fits). Decode speed is measured as the difference between a run of N new
tokens and a run of 1 (prefill and first token cancel out); the roofline is batch x copy bandwidth /
weight bytes, since a decode step must read every weight once. With `--dtype fp8` every shape runs twice,
with block-scaled FP8 weights (the roofline counts their bytes, scales included) and then with bf16
weights, and the FP8 rows carry their speed-up over bf16 (transformers runs beside the bf16 rows only: it
has no twin on hsmc's FP8 tensors).

For a config (levels may name `random:SHAPE` models), each row is one number of requests decoded
together: tok/s per request and over all of them, the top level's step (SMC cycle) time against its
weight-read bound (every forward of the step reading its weights once, `hsmc.cost_model.roofline`), the
cost model's prediction from the measured per-forward times and acceptance (and at stated accepted
lengths of the rejection levels), and per level its share of the time, forward ms, accepted length, ESS,
resample and deferral rates. A config on the CPU runs too (for tests). Numbers, not pass/fail.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hsmc.config import HsmcConfig, load_config
from hsmc.cost_model import LevelCost, predict, roofline, with_accepted_length
from hsmc.engine.scheduler import rows_and_lookahead
from hsmc.errors import ConfigError
from hsmc.models.config import DecoderConfig
from hsmc.models.decoder import DecoderLM
from hsmc.models.loading import COMPUTE_DTYPES, LoadedModel
from hsmc.models.shapes import RANDOM_PREFIX, SHAPES, hf_config, random_model
from hsmc.models.size import weight_bytes


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


@dataclass
class StackRow:
    """One number of requests through a config's stack (see the module docstring)."""

    name: str
    batch: int  # requests decoded together
    new_tokens: int
    tok_s_request: float  # decode tokens/s of one request
    tok_s_total: float  # over all requests
    step_ms: float  # one step of the top level (an SMC cycle), measured
    bound_step_ms: float  # the same step with every forward reading its weights once
    bound_tok_s_request: float
    predicted_tok_s_request: float  # cost model from the measured per-forward times and acceptance
    predicted_at: dict[str, float] = field(default_factory=dict)  # accepted length -> predicted tok/s per request
    levels: list[dict[str, Any]] = field(default_factory=list)
    eager_cycles_tok_s_request: float | None = None  # graphed SMC cycles: the same run with cycles op by op

    @property
    def of_bound(self) -> float:
        return self.step_ms / self.bound_step_ms if self.bound_step_ms > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, gigabytes: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the best of five
    timed windows after a warm-up long enough to bring the clocks up, so the roofline is not set low."""
    x = torch.empty(int(gigabytes * 2**30), dtype=torch.uint8, device=device)
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(30 if device.type == "cuda" else 2):
        y.copy_(x)
    best = 0.0
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        _sync(device)
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


def _decode_seconds(t_all: float, t_one: float, case: str) -> float:
    """Decode time: the N-token run minus the 1-token run (prefill and setup cancel). A difference that is not
    positive is noise larger than the decode itself, not a speed."""
    if t_all <= t_one:
        raise RuntimeError(
            f"bench {case}: the {t_all:.3f} s run of all new tokens was not slower than the {t_one:.3f} s run of one; "
            "decode speed cannot be told from noise (use more --new-tokens)"
        )
    return t_all - t_one


def timed(fn, device: torch.device | None = None) -> float:
    """Seconds `fn` takes on `device` (default: the current CUDA device), its queued work included."""
    device = device or torch.device("cuda")
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
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

        # warm-up: both timed runs once (kernels compiled, graphs captured): a first 1-token run can compile kernels
        # the longer run did not (docs/measurements/2026-11-30-h200-bench-one-token-warmup.txt)
        run(new_tokens)
        run(1)
        t_one = timed(lambda: run(1))
        results: list = []
        t_all = timed(lambda: results.extend(run(new_tokens)))
        decode = b * (new_tokens - 1) / _decode_seconds(t_all, t_one, name)
        baseline = None
        if hf is not None:
            inputs = prompts.to(top.lm_head.weight.device)

            def run_hf(n: int) -> None:
                with torch.no_grad():
                    hf.generate(inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)

            run_hf(4)
            hf_one = timed(lambda: run_hf(1))
            hf_all = timed(lambda: run_hf(new_tokens))
            baseline = b * (new_tokens - 1) / _decode_seconds(hf_all, hf_one, f"{name} (transformers)")
        levels = results[0].stats["levels"]
        rows.append(BenchRow(name, b, new_tokens, decode, b * new_tokens / t_all, baseline, b * roof, levels))
    return rows


def shape_case(
    shape: str, dtype: str, device: torch.device, engine: dict[str, Any]
) -> tuple[Any, DecoderLM, Any | None]:
    """A one-level decoder over random weights of a named shape, and its transformers twin (None for fp8). Sharded
    (`engine.tensor_parallel` > 1), every rank draws its own shard (`random:` models), the model returned is rank
    0's (its bytes make the per-GPU roofline) and there is no twin."""
    from hsmc.decoder import HierarchicalDecoder

    engine = {"device": str(device), **engine}
    if engine.get("tensor_parallel", 1) > 1:
        config = load_config({"levels": [{"model": RANDOM_PREFIX + shape, "dtype": dtype}], "engine": engine})
        decoder = HierarchicalDecoder(config)
        return decoder, decoder.stack.top.state.runner.module, None
    hf_cfg = hf_config(shape)
    cfg = DecoderConfig.from_hf(hf_cfg, source=shape)
    fp8 = dtype == "fp8"
    model = random_model(cfg, COMPUTE_DTYPES[dtype], device, fp8=fp8)
    config = load_config({"levels": [{"model": shape, "dtype": dtype}], "engine": engine})
    decoder = HierarchicalDecoder(config, models={shape: LoadedModel(model, None, shape)})
    return decoder, model, None if fp8 else hf_twin(model, hf_cfg)


def level_modules(decoder: Any) -> list[torch.nn.Module]:
    """The module each level runs (an EAGLE3 level's head; every other level's model)."""
    return [runner.module for runner in decoder.stack.runners]


def level_costs(decoder: Any, stats: list[dict[str, Any]]) -> list[LevelCost]:
    """The cost model's view of a run: each level's measured forward time, acceptance, fill rounds and deferrals."""
    return [
        LevelCost(
            kind=lc.kind,
            forward_ms=st["forward_ms"],
            gamma=st.get("mean_draft_tokens", lc.path_length),  # a chosen shape: the mean its rounds took
            accepted_length=st.get("mean_accepted_length", 1.0),
            fill_rounds=st.get("mean_fill_rounds"),
            block_size=lc.block_size,
            particles=lc.particles,
            deferral_rate=st.get("deferred_step_rate"),
            round_includes_drafts="graphed_rounds" in st,
            cycle_includes_proposal="graphed_cycles" in st,
        )
        for lc, st in zip(decoder.stack.configs, stats)
    ]


def bench_stack(
    name: str,
    decoder: Any,
    batches: list[int],
    prompt_tokens: int,
    new_tokens: int,
    bandwidth: float,
    accepted_lengths: tuple[float, ...] = (3.5,),
    seed: int = 0,
) -> list[StackRow]:
    """Time a config's stack for every number of requests; steps are counted by the top level's forwards."""
    device = decoder.stack.device
    vocab = level_modules(decoder)[-1].config.vocab_size
    weight_ms = [1000 * weight_bytes(m) / bandwidth for m in level_modules(decoder)]
    has_rejection = any(lc.kind == "rejection" for lc in decoder.stack.configs)
    top = decoder.stack.top
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(seed + b)
        ids = torch.randint(0, vocab, (b, prompt_tokens), generator=g).tolist()

        def measure() -> tuple[float, list[dict[str, Any]], list[dict[str, Any]]]:
            """Decode seconds, and the level stats of the 1-token and of the N-token run, after two warm-up runs
            (kernels compiled, graphs captured: a round's or a cycle's graph once its shape made 8 of the last 16,
            and a run of 128 tokens at K = 16 is 8 cycles)."""
            runs: list[list] = []

            def run(n: int) -> None:
                runs.append(decoder.generate(ids, max_new_tokens=n, ignore_eos=True))

            run(new_tokens)
            run(new_tokens)
            run(1)  # the 1-token run warmed up too (`bench_decoder`)
            t_one = timed(lambda: run(1), device)
            t_all = timed(lambda: run(new_tokens), device)
            one, full = (r[0].stats["levels"] for r in runs[-2:])
            return _decode_seconds(t_all, t_one, name), one, full

        decode, one, full = measure()
        steps = max(full[-1]["forwards"] - one[-1]["forwards"], 1)
        tok_s_total = b * (new_tokens - 1) / decode
        levels, eager_tok_s = full, None
        if getattr(top, "cycle_graphs", None) is not None:  # a graphed cycle is timed whole: the levels' own
            top.replay_cycles = False  # times come from cycles launched op by op (on every rank: a stack mode)
            try:
                eager_decode, _, levels = measure()
            finally:
                top.replay_cycles = True
            eager_tok_s = (new_tokens - 1) / eager_decode
        costs = level_costs(decoder, levels)
        bound = roofline(costs, weight_ms)
        predicted_at = {}
        if has_rejection:
            predicted_at = {f"{a:g}": predict(with_accepted_length(costs, a)).tokens_per_s for a in accepted_lengths}
        rows.append(
            StackRow(
                name=name,
                batch=b,
                new_tokens=new_tokens,
                tok_s_request=tok_s_total / b,
                tok_s_total=tok_s_total,
                step_ms=1000 * decode / steps,
                bound_step_ms=bound.step_ms,
                bound_tok_s_request=bound.tokens_per_s,
                predicted_tok_s_request=predict(costs).tokens_per_s,
                predicted_at=predicted_at,
                levels=levels,
                eager_cycles_tok_s_request=eager_tok_s,
            )
        )
    return rows


def format_stack_table(rows: list[StackRow]) -> str:
    lines = [
        f"{'case':<14}{'reqs':>5}{'tok/s/req':>11}{'tok/s all':>11}{'step ms':>9}{'bound ms':>10}{'x bound':>9}"
        f"{'bound tok/s':>12}{'model tok/s':>12}  at accepted length"
    ]
    for r in rows:
        at = ", ".join(f"{a}: {v:.1f}" for a, v in r.predicted_at.items()) or "-"
        lines.append(
            f"{r.name:<14}{r.batch:>5}{r.tok_s_request:>11.1f}{r.tok_s_total:>11.1f}{r.step_ms:>9.2f}"
            f"{r.bound_step_ms:>10.2f}{r.of_bound:>8.2f}x{r.bound_tok_s_request:>12.1f}"
            f"{r.predicted_tok_s_request:>12.1f}  {at}"
        )
        for lv in r.levels:
            extras = [
                f"{label} {lv[key]:.2f}"
                for key, label in (
                    ("mean_accepted_length", "accepted"),
                    ("mean_fill_rounds", "fill rounds"),
                    ("mean_ess_fraction", "ESS/N"),
                    ("resample_rate", "resample"),
                    ("deferred_step_rate", "deferred"),
                )
                if key in lv
            ]
            lines.append(
                f"    {lv['kind']:<10}{lv['share_of_time']:>7.1%} of time, {lv['forward_ms']:.2f} ms/forward"
                + "".join(f", {e}" for e in extras)
            )
        if r.eager_cycles_tok_s_request:
            lines.append(
                f"    eager cycles (same run, the levels above timed there): {r.eager_cycles_tok_s_request:.1f} "
                f"tok/s/req; graphed cycles {r.tok_s_request / r.eager_cycles_tok_s_request:.2f}x"
            )
    lines.append(
        "tok/s: decode only (N-token run minus 1-token run); step: the top level's step (an SMC cycle); bound: "
        "each forward reading its weights once at the copy bandwidth; model: hsmc.cost_model from the measured "
        "forward times (with graphed SMC cycles, those of the eager-cycle run)"
    )
    return "\n".join(lines)


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


def plot(rows: list[BenchRow | StackRow], path: Path) -> None:
    """tok/s vs batch of the shapes' rows, their rooflines and baselines drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if isinstance(r, BenchRow)]
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


def config_for_bench(config: HsmcConfig, batches: list[int], prompt_tokens: int, new_tokens: int) -> HsmcConfig:
    """`config` with engine rows and KV slots for the largest number of requests (kept where it has more)."""
    rows_per_prompt, lookahead = rows_and_lookahead(config)
    b = max(batches)
    engine = config.engine
    needed = b * (prompt_tokens + rows_per_prompt * (new_tokens + lookahead)) + 64
    capacity = engine.resolved_kv_capacity  # "auto" too becomes what the runs need: the rest stays free for them
    capacity = needed if capacity == "auto" else max(capacity, needed)
    rows = engine.resolved_max_batch_rows
    rows = b * rows_per_prompt if rows == "auto" else max(rows, b * rows_per_prompt)
    engine = dataclasses.replace(engine, max_batch_rows=rows, kv_capacity_tokens=capacity)
    return dataclasses.replace(config, engine=engine)


def run_bench(
    shapes: list[str],
    config: HsmcConfig | None,
    batches: list[int],
    prompt_tokens: int,
    new_tokens: int,
    dtype: str,
    baseline: bool,
    engine: dict[str, Any],
    name: str = "config",
) -> tuple[list[BenchRow | StackRow], str]:
    """Benchmark every named shape (on CUDA) and the config's stack (on its device); returns the rows and the
    printed tables."""
    if new_tokens < 2:
        raise ConfigError(f"--new-tokens={new_tokens}: decode speed is the N-token run minus the 1-token run, N >= 2")
    device = torch.device(config.engine.device if config is not None and not shapes else "cuda")
    bandwidth = copy_bandwidth(device, 2.0 if device.type == "cuda" else 0.05)
    rows: list[BenchRow] = []
    for shape in shapes:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        by_dtype: dict[str, list[BenchRow]] = {}
        for case_dtype in ("fp8", "bfloat16") if dtype == "fp8" else (dtype,):
            decoder, model, hf = shape_case(shape, case_dtype, device, engine)
            case = f"{shape} {case_dtype}" if dtype == "fp8" else shape
            by_dtype[case_dtype] = bench_decoder(
                case, decoder, model, hf if baseline else None, batches, prompt_tokens, new_tokens, bandwidth
            )
            decoder.close()  # tensor-parallel ranks stop before the next case starts its own
            del decoder, model, hf
            gc.collect()  # runners and their CUDA graphs reference each other: free them before the next case
            torch.cuda.empty_cache()
        if dtype == "fp8":
            for fp8_row, bf16_row in zip(by_dtype["fp8"], by_dtype["bfloat16"]):
                fp8_row.vs_bf16 = fp8_row.hsmc_tok_s / bf16_row.hsmc_tok_s
        rows += [r for case in by_dtype.values() for r in case]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tables = [format_table(rows, device_name, bandwidth)] if rows else []
    stack_rows: list[StackRow] = []
    if config is not None:
        from hsmc.decoder import HierarchicalDecoder

        decoder = HierarchicalDecoder(config_for_bench(config, batches, prompt_tokens, new_tokens))
        stack_rows = bench_stack(name, decoder, batches, prompt_tokens, new_tokens, bandwidth)
        decoder.close()
        if not rows:
            tables.append(f"device: {device_name}; measured copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)")
        tables.append(format_stack_table(stack_rows))
    return [*rows, *stack_rows], "\n".join(tables)


def to_json(rows: list[BenchRow | StackRow]) -> str:
    def row(r: BenchRow | StackRow) -> dict[str, Any]:
        if isinstance(r, StackRow):
            return {**asdict(r), "of_bound": r.of_bound}
        return {**asdict(r), "of_roofline": r.of_roofline, "vs_baseline": r.vs_baseline}

    return json.dumps([row(r) for r in rows])
