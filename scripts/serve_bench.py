"""Serving on the GPU, with random weights of the Qwen3 shapes: no capture inside the first requests, and HTTP
against in-process throughput.

For each stack it prints, in one run on one GPU, with `engine.warmup` on as `hsmc serve` runs (and the KV pool sized
automatically but for the hierarchical stack):
- the time to load and warm up, then 20 identical requests: max / median latency (target <= 1.15);
- 16 concurrent requests through `hsmc serve`'s app over HTTP (loopback, streaming, the clients in a process of
  their own as real clients are) against the same 16 requests through in-process `generate`: tok/s in all and
  their ratio (target >= 0.9), time to first token p50 / p99 of each, and whether every HTTP output equals the
  in-process one (same seeds); then once more with the client's connections opened before the clock starts (its
  16 streams reach the server 40-95 ms after a fresh client process starts them, on a 2-core CPU);
- the rows `engine.max_batch_rows: auto` would give the stack on this GPU.
(Tiny stacks on CUDA against the CPU, graphed against eager, and the synchronizing calls: `python -m pytest -m gpu`.)

    python scripts/serve_bench.py --out DIR [--stacks 8b,smc,hierarchical] [--new-tokens 64] [--memory-gib 79]

Other stacks: `hierarchical-kv-auto` (its KV sized automatically) and `headline` (configs/qwen3_32b.yaml's shape and
engine); `--memory-gib 79` holds a larger GPU to an H100 80 GB's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hsmc.levels.stack  # noqa: E402
from hsmc.config import load_config  # noqa: E402
from hsmc.decoder import HierarchicalDecoder  # noqa: E402
from hsmc.engine.kv_sizing import with_rows  # noqa: E402
from hsmc.requests import SamplingParams, derive_seed  # noqa: E402

STACKS = {
    "8b": (
        [{"kind": "model", "model": "random:qwen3-8b", "dtype": "bfloat16", "temperature": 1.0}],
        {"max_batch_rows": 16},
    ),
    "smc": (
        [
            {"kind": "model", "model": "random:qwen3-8b", "dtype": "fp8", "temperature": 1.0},
            {"kind": "smc", "model": "random:qwen3-32b", "dtype": "fp8", "temperature": 1.0, "particles": 8,
             "block_size": 8},
        ],
        {"max_batch_rows": 128, "fp8_activations": True},
    ),
    "hierarchical": (
        [
            {"kind": "eagle3", "model": "random:qwen3-8b", "dtype": "bfloat16", "temperature": 1.0},
            {"kind": "rejection", "model": "random:qwen3-8b", "dtype": "fp8", "temperature": 1.0,
             "num_draft_tokens": 4},
            {"kind": "smc", "model": "random:qwen3-32b", "dtype": "fp8", "temperature": 1.0, "particles": 6,
             "block_size": 16},
        ],
        # auto-sized KV ran out of memory in this warmup on an H100 (docs/measurements/...-h100-serve-bench.txt)
        {"max_batch_rows": 96, "fp8_activations": True, "kv_capacity_tokens": 16000},
    ),
}  # fmt: skip
# the hierarchical stack as `hsmc serve` sizes it by default: KV slots from the memory left (`kv_capacity_tokens: auto`)
STACKS["hierarchical-kv-auto"] = (STACKS["hierarchical"][0], {"max_batch_rows": 96, "fp8_activations": True})
# configs/qwen3_32b.yaml's shape and engine (48 rows, KV auto) with random weights, at its temperature
STACKS["headline"] = (
    [{**level, "temperature": 0.6} for level in STACKS["hierarchical"][0]],
    {"max_batch_rows": 48, "fp8_activations": True},
)
CLIENTS = 16


def say(line: str, log: list[str]) -> None:
    print(line, flush=True)
    log.append(line)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def timed_generate(decoder: HierarchicalDecoder, prompts, params) -> tuple[float, list]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = decoder.generate(prompts, params=params)
    torch.cuda.synchronize()
    return time.perf_counter() - start, results


def http_run(
    decoder: HierarchicalDecoder, prompts, params: list[SamplingParams], open_first: bool = False
) -> tuple[float, list, list, list]:
    """The requests through the server's app (uvicorn on a loopback port, streaming completions with token-id
    prompts), all at once from a client process of their own: wall seconds, each one's time to its first content
    chunk at the client and in the engine (from its submission), and its token ids. `open_first`: the client opens
    its connections before the clock starts (one `GET /health` each, kept alive), as a client that has sent requests
    before has them open."""
    import multiprocessing

    import uvicorn

    from hsmc.serve.app import create_app

    app = create_app(decoder, "bench", 1024)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    bodies = [{"model": "bench", "prompt": q, "max_tokens": p.max_tokens, "seed": p.seed, "ignore_eos": True,
               "stream": True} for q, p in zip(prompts, params)]  # fmt: skip
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    clients = context.Process(target=client_process, args=(port, bodies, results, open_first))
    clients.start()
    seconds, done = results.get()
    clients.join()
    server.should_exit = True
    thread.join()
    return seconds, [d[0] for d in done], [d[1] for d in done], [d[2] for d in done]


def client_process(port: int, bodies: list[dict], results, open_first: bool) -> None:
    """Streams every body at once to the server and puts (wall seconds, [(time to the first streamed token at the
    client, in the engine after submission, the output's ids)]) on `results`; with `open_first` its connections are
    opened before the clock starts."""
    import httpx

    async def one(client: httpx.AsyncClient, body: dict) -> tuple[float, float, list[int]]:
        start, first, engine_first, tokens = time.perf_counter(), None, float("nan"), []
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                ext = choice.get("hsmc") or {}
                if choice.get("finish_reason") is not None:  # the last chunk: the whole output's ids
                    tokens, engine_first = ext["token_ids"], ext["first_token_seconds"]
                elif ext.get("token_ids") and first is None:
                    first = time.perf_counter() - start
        return first or float("nan"), engine_first, tokens

    async def run() -> tuple[float, list]:
        async with httpx.AsyncClient(timeout=600) as client:
            if open_first:
                await asyncio.gather(*(client.get(f"http://127.0.0.1:{port}/health") for _ in bodies))
            start = time.perf_counter()
            done = await asyncio.gather(*(one(client, body) for body in bodies))
            return time.perf_counter() - start, done

    results.put(asyncio.run(run()))


def cap_memory(gib: float) -> None:
    """Hold this process to `gib` of the GPU (allocations and the KV sizing's free memory), as on a smaller GPU of
    the same kind: an H100 80 GB leaves a process about 79 GiB."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))
    real = hsmc.levels.stack.free_memory
    hsmc.levels.stack.free_memory = lambda d: min(real(d), int(gib * 2**30) - torch.cuda.memory_reserved(d))


def bench(name: str, new_tokens: int, log: list[str]) -> dict:
    levels, engine = STACKS[name]
    config = load_config({"levels": levels, "engine": {"device": "cuda", "warmup": True, **engine}})
    start = time.perf_counter()
    decoder = HierarchicalDecoder(config)
    ready = time.perf_counter() - start
    say(f"== {name}: loaded and warmed up in {ready:.1f} s; rows {decoder.stack.max_rows}, KV slots "
        f"{decoder.stack.capacity}", log)  # fmt: skip
    auto = load_config({"levels": levels, "engine": {"device": "cuda"}})
    modules = [runner.module for runner in decoder.stack.runners]
    free = hsmc.levels.stack.free_memory(torch.device("cuda"))  # held to --memory-gib where given
    rows = with_rows(auto, modules, free + decoder_kv_bytes(decoder))
    say(f"{name}: engine.max_batch_rows: auto would give {rows.engine.max_batch_rows} rows on this GPU", log)
    vocab = modules[-1].config.vocab_size
    prompt = [(7919 * i) % vocab for i in range(128)]
    one = SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=1)
    after = [timed_generate(decoder, [prompt], one)[0] for _ in range(20)]
    ratio = max(after) / statistics.median(after)
    say(f"{name}: after warmup: {torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved by torch, peak allocated "
        f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", log)  # fmt: skip
    say(f"{name}: 20 identical requests after it: median {statistics.median(after):.3f} s, "
        f"max {max(after):.3f} s, max/median {ratio:.3f} (target <= 1.15)", log)  # fmt: skip
    prompts = [[(7919 * (i + 1) + 31 * j) % vocab for j in range(128)] for i in range(CLIENTS)]
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=100 + i) for i in range(CLIENTS)]
    # `hsmc serve` gives choice 0 of a request seeded s the stream derive_seed(s, 0)
    inproc_params = [dataclasses.replace(p, seed=derive_seed(p.seed, 0)) for p in params]
    first = [timed_generate(decoder, prompts, [dataclasses.replace(p, max_tokens=1) for p in params])[0]
             for _ in range(3)]  # fmt: skip
    say(f"{name}: {CLIENTS} requests of 1 token (prefill + one step), three times: "
        f"{' / '.join(f'{t:.3f}' for t in first)} s", log)  # fmt: skip
    inproc_s, inproc = timed_generate(decoder, prompts, inproc_params)
    inproc_ttft = [r.stats["first_token_seconds"] for r in inproc]
    cold_s, cold_ttft, cold_engine, _ = http_run(decoder, prompts, params)  # the app's first requests
    say(f"{name}: HTTP, the app's first {CLIENTS} requests: {tokens_of(params) / cold_s:.1f} tok/s; TTFT at the "
        f"client p50/p99 {percentile(cold_ttft, 0.5):.3f}/{percentile(cold_ttft, 0.99):.3f} s, in the engine from "
        f"submission {percentile(cold_engine, 0.5):.3f}/{percentile(cold_engine, 0.99):.3f} s", log)  # fmt: skip
    http_s, http_ttft, http_engine, http_tokens = http_run(decoder, prompts, params)
    say(f"{name}: HTTP again: TTFT in the engine from submission p50/p99 {percentile(http_engine, 0.5):.3f}/"
        f"{percentile(http_engine, 0.99):.3f} s", log)  # fmt: skip
    open_s, _, _, open_tokens = http_run(decoder, prompts, params, open_first=True)
    tokens = CLIENTS * new_tokens
    equal = sum(a.token_ids == b for a, b in zip(inproc, http_tokens))
    equal_open = sum(a.token_ids == b for a, b in zip(inproc, open_tokens))
    for a, b in zip(inproc, http_tokens):
        if a.token_ids != b:  # where a differing output first departs (bf16 numerics of another batching)
            at = next((i for i, (x, y) in enumerate(zip(a.token_ids, b)) if x != y), min(len(a.token_ids), len(b)))
            say(f"{name}: an HTTP output departs from the in-process one at token {at} of {len(a.token_ids)}", log)
    row = {
        "load_and_warmup_s": ready,
        "after_warmup_s": after,
        "max_over_median": ratio,
        "inprocess_tok_s": tokens / inproc_s,
        "http_tok_s": tokens / http_s,
        "http_over_inprocess": inproc_s / http_s,
        "http_open_tok_s": tokens / open_s,
        "http_open_over_inprocess": inproc_s / open_s,
        "http_open_equal_inprocess": f"{equal_open}/{CLIENTS}",
        "ttft_inprocess_p50_p99": [percentile(inproc_ttft, 0.5), percentile(inproc_ttft, 0.99)],
        "ttft_http_p50_p99": [percentile(http_ttft, 0.5), percentile(http_ttft, 0.99)],
        "http_equal_inprocess": f"{equal}/{CLIENTS}",
        "slots_in_use_after": decoder.kv_slots_in_use(),
        "levels": inproc[0].levels,
    }
    say(f"{name}: {CLIENTS} requests x {new_tokens} tokens: in-process {row['inprocess_tok_s']:.1f} tok/s, HTTP "
        f"{row['http_tok_s']:.1f} tok/s ({row['http_over_inprocess']:.2f}x, target >= 0.9); TTFT p50/p99 in-process "
        f"{row['ttft_inprocess_p50_p99'][0]:.3f}/{row['ttft_inprocess_p50_p99'][1]:.3f} s, HTTP "
        f"{row['ttft_http_p50_p99'][0]:.3f}/{row['ttft_http_p50_p99'][1]:.3f} s; HTTP outputs equal in-process "
        f"{row['http_equal_inprocess']}; KV slots in use after {row['slots_in_use_after']}", log)  # fmt: skip
    say(f"{name}: the same over connections opened before the clock: HTTP {row['http_open_tok_s']:.1f} tok/s "
        f"({row['http_open_over_inprocess']:.2f}x); outputs equal in-process {row['http_open_equal_inprocess']}",
        log)  # fmt: skip
    decoder.close()
    return row


def tokens_of(params: list[SamplingParams]) -> int:
    return sum(p.max_tokens for p in params)


def decoder_kv_bytes(decoder: HierarchicalDecoder) -> int:
    """Bytes the decoder's KV caches hold (free again were it built with other rows)."""
    return sum(r.cache.data.numel() * r.cache.data.element_size() for r in decoder.stack.runners)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stacks", default="8b,smc,hierarchical")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--one", help="run this stack alone (the parent runs each stack so)")
    parser.add_argument("--memory-gib", type=float, help="hold each stack to this much GPU memory (79: an H100 80 GB)")
    args = parser.parse_args()
    out, log = Path(args.out), []
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        if args.memory_gib:
            cap_memory(args.memory_gib)
        (out / f"{args.one}.json").write_text(json.dumps(bench(args.one, args.new_tokens, []), indent=1))
        return
    say(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", log)
    results = {"device": torch.cuda.get_device_name()}
    for name in args.stacks.split(","):  # each stack in a process of its own: its GPU memory is all free after
        one = out / f"{name}.json"
        command = [sys.executable, __file__, "--one", name, "--out", str(out), "--new-tokens", str(args.new_tokens)]
        command += ["--memory-gib", str(args.memory_gib)] if args.memory_gib else []
        run = subprocess.run(command, capture_output=True, text=True)
        for line in run.stdout.splitlines():
            say(line, log)
        if run.returncode != 0 or not one.is_file():
            say(f"!! {name} failed: {run.stderr[-3000:]}", log)
            results[name] = {"error": run.stderr[-3000:]}
        else:
            results[name] = json.loads(one.read_text())
    (out / "serve_bench.json").write_text(json.dumps(results, indent=1))
    (out / "serve_bench.txt").write_text("\n".join(log) + "\n")
    if any("error" in v for v in results.values() if isinstance(v, dict)):
        sys.exit(1)


if __name__ == "__main__":
    main()
