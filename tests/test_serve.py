"""`hsmc serve`: OpenAI's API over the request driver. Seeded responses equal `decoder.generate` (the official
`openai` client against a real `hsmc serve` process, and 64 concurrent streaming clients); bad requests are 400s in
OpenAI's error shape naming the field; a client that leaves, a request that fails in the engine and a full queue
cost nobody else anything, and leave no KV slot behind; SIGTERM and Ctrl-C stop the server cleanly, exit 0."""

from __future__ import annotations

import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from conftest import TINY_CONFIGS, make_tiny_model, save_tokenizer
from helpers import assert_pools_empty

from hsmc.decoder import HierarchicalDecoder
from hsmc.requests import Particle, Result, SamplingParams, SMCOutcome, derive_seed
from hsmc.serve import create_app
from hsmc.serve.responses import CompletionFormat, extension, usage
from hsmc.stopping import StopCriteria

REPO = Path(__file__).resolve().parents[1]
VOCAB = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(TINY_CONFIGS["llama"]["vocab_size"])]
# letters only, so that every prompt it renders is in the vocabulary: u<user text>a<assistant text>...z
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}z{% endif %}"
)
ENGINE = {"max_batch_rows": 128, "kv_capacity_tokens": 16384}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    """YAML configs of a rejection top and an smc top over two tiny llamas with a chat-templated tokenizer."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("serve")
    folders = {}
    for name, seed in (("small", 11), ("big", 12)):
        folder = make_tiny_model("llama", root / name, seed=seed, max_position_embeddings=4096)
        save_tokenizer(folder, VOCAB)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(folder)
        folders[name] = str(folder)
    small = {"kind": "model", "model": folders["small"], "temperature": 1.0}
    tops = {
        "rejection": {"kind": "rejection", "model": folders["big"], "temperature": 1.0, "num_draft_tokens": 3},
        "smc": {"kind": "smc", "model": folders["big"], "temperature": 1.0, "particles": 3, "block_size": 2},
    }
    paths = {}
    for name, top in tops.items():
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(json.dumps({"levels": [small, top], "engine": ENGINE}))  # JSON is YAML
    return paths


@pytest.fixture(scope="module")
def decoders(configs) -> Iterator[dict[str, HierarchicalDecoder]]:
    built = {name: HierarchicalDecoder.from_config(path) for name, path in configs.items()}
    yield built
    for decoder in built.values():
        decoder.close()


@contextmanager
def live_server(app) -> Iterator[str]:
    """uvicorn serving `app` on a thread, on an ephemeral loopback port: real sockets, real disconnects."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def servers(decoders) -> Iterator[dict[str, str]]:
    """An in-process server per decoder; the model name is the config's name."""
    with live_server(create_app(decoders["rejection"], "rejection", 256)) as rejection:
        with live_server(create_app(decoders["smc"], "smc", 256)) as smc:
            yield {"rejection": rejection, "smc": smc}


def chat_ids(decoder: HierarchicalDecoder, messages: list[dict]) -> list[int]:
    text = decoder.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return decoder.tokenizer(text, add_special_tokens=False)["input_ids"]


def wait_idle(decoder: HierarchicalDecoder, timeout: float = 20.0) -> None:
    """Until the driver holds no request, then every pool is whole."""
    deadline = time.monotonic() + timeout
    while decoder.driver.running_rows or decoder.driver.queue_depth:
        assert time.monotonic() < deadline, "requests still hold rows"
        time.sleep(0.02)
    assert decoder.driver.quiesce()
    assert decoder.kv_slots_in_use() == 0
    assert_pools_empty(decoder)


def metric(base: str, line: str) -> float:
    """The value of one sample of /metrics, e.g. `hsmc_requests_total{status="ok"}`."""
    for row in httpx.get(f"{base}/metrics").text.splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    raise AssertionError(f"{line} not in /metrics")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(config: Path, *args: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """A real `hsmc serve` process, up once /health answers."""
    port = free_port()
    command = [sys.executable, "-m", "hsmc.cli", "serve", "--config", str(config), "--port", str(port), *args]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, f"hsmc serve exited: {process.communicate()[0]}"
            assert time.monotonic() < deadline, "hsmc serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield process, port
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


# -- the CLI -------------------------------------------------------------------------------------------------------
def test_serve_help_imports_neither_torch_nor_fastapi():
    script = (
        "import sys\nfrom hsmc.cli import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules, 'imported by --help'\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--shutdown-timeout" in run.stdout and "--max-queue" in run.stdout


def test_serve_with_a_config_that_cannot_load_exits_2_naming_the_level(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(json.dumps({"levels": [{"kind": "model", "model": str(tmp_path / "missing")}]}))
    run = subprocess.run([sys.executable, "-m", "hsmc.cli", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert run.returncode == 2, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("hsmc: error:")]
    assert len(lines) == 1 and "missing" in lines[0] and "level" in lines[0], run.stderr[-3000:]


# -- a real server, the official client, load ----------------------------------------------------------------------
@pytest.mark.parametrize("top", ["rejection", "smc"])
def test_openai_client_and_64_streaming_clients_get_what_generate_gives(configs, decoders, top):
    """Completions and chat, streamed and not, n = 2, then 64 concurrent streaming clients: every choice equals
    `decoder.generate` with the same seed in the test process; afterwards no KV slot is held; Ctrl-C exits 0."""
    decoder = decoders[top]
    with served(configs[top], "--served-model-name", "tiny") as (process, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]

        ids = decoder.tokenizer("hello")["input_ids"]
        expected = decoder.generate([ids] * 2, seed=7, max_new_tokens=16)
        answer = client.completions.create(model="tiny", prompt="hello", max_tokens=16, seed=7, n=2)
        assert [c.text for c in answer.choices] == [r.text for r in expected]
        assert [c.finish_reason for c in answer.choices] == [r.finish_reason for r in expected]
        assert answer.usage.prompt_tokens == len(ids)
        assert answer.usage.completion_tokens == sum(len(r.token_ids) for r in expected)
        levels = answer.choices[0].hsmc["levels"]
        assert [level["kind"] for level in levels] == ["model", top]
        if top == "smc":
            assert answer.choices[0].hsmc["log_z"] == pytest.approx(expected[0].smc.log_z, rel=1e-4)

        stream = client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=20, seed=3, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        (expected,) = decoder.generate([[5, 6, 7]], seed=3, max_new_tokens=20)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
        assert chunks[-1].usage.completion_tokens == len(expected.token_ids) and not chunks[-1].choices

        messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "brief"}]
        (expected,) = decoder.generate([chat_ids(decoder, messages)], seed=11, max_new_tokens=12)
        chat = client.chat.completions.create(model="tiny", messages=messages, seed=11, max_completion_tokens=12)
        assert chat.choices[0].message.content == expected.text and chat.choices[0].message.role == "assistant"
        chunks = list(
            client.chat.completions.create(model="tiny", messages=messages, seed=11, max_tokens=12, stream=True)
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        assert chunks[-1].choices[0].finish_reason == expected.finish_reason

        requests = [
            {
                "chat": i % 3 == 0,
                "text": "".join(VOCAB[(i * 7 + j) % 26] for j in range(2 + i % 5)),
                "seed": 1000 + i,
                "n": 2 if i % 8 == 0 else 1,
                "max_tokens": 8 + i % 17,
                "stop": ["ab"] if i % 4 == 1 else None,
            }
            for i in range(64)
        ]
        start = threading.Barrier(len(requests))

        def stream_one(request: dict) -> tuple[dict[int, str], dict[int, str]]:
            args = {"model": "tiny", "seed": request["seed"], "n": request["n"], "stop": request["stop"]}
            args.update(max_tokens=request["max_tokens"], stream=True)
            start.wait()
            if request["chat"]:
                chunks = client.chat.completions.create(messages=[{"role": "user", "content": request["text"]}], **args)
                texts = [
                    (c.choices[0].index, c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in chunks
                ]
            else:
                chunks = client.completions.create(prompt=request["text"], **args)
                texts = [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason) for c in chunks]
            text, finish = {}, {}
            for index, piece, reason in texts:
                text[index] = text.get(index, "") + piece
                finish[index] = reason or finish.get(index)
            return text, finish

        began = time.monotonic()
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(stream_one, requests))
        seconds = time.monotonic() - began
        assert seconds < 60, f"the load run took {seconds:.1f}s"
        print(f"{top}: 64 concurrent streaming clients in {seconds:.1f}s")

        prompts, params = [], []
        for request in requests:
            user = [{"role": "user", "content": request["text"]}]
            ids = chat_ids(decoder, user) if request["chat"] else decoder.tokenizer(request["text"])["input_ids"]
            for j in range(request["n"]):
                prompts.append(ids)
                stop = tuple(request["stop"] or ())
                params.append(
                    SamplingParams(max_tokens=request["max_tokens"], stop=stop, seed=derive_seed(request["seed"], j))
                )
        results = iter(decoder.generate(prompts, params=params))
        for request, (text, finish) in zip(requests, answers):
            for j in range(request["n"]):
                result = next(results)
                assert (text[j], finish[j]) == (result.text, result.finish_reason), request
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert health == {"status": "ok", "queue_depth": 0, "running_rows": 0, "kv_slots_in_use": 0}

        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0


def test_sigterm_mid_stream_stops_listening_cancels_and_exits_0(configs):
    """A stream outlasting --shutdown-timeout ends with an error event and [DONE]; the port is closed at once;
    the process exits 0 within the timeout plus the time to stop."""
    timeout = 1.5
    with served(configs["rejection"], "--shutdown-timeout", str(timeout)) as (process, port):
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "abc", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        first = threading.Event()

        def read() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(30)
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health", timeout=2)
        assert process.wait(30) == 0
        stopped = time.monotonic() - sent
        reader.join(10)
    assert stopped < timeout + 6, f"took {stopped:.1f}s to stop"  # the interpreter's own exit takes 1-2 s here
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["error"]["message"] == "the request was cancelled: shut down"
    assert [line for line in lines if line][-1] == "data: [DONE]"


# -- bad requests ------------------------------------------------------------------------------------------------
BAD = [
    ("completions", "rejection", b'{"model": "rejection", "prompt": "ab",', None),
    ("completions", "rejection", b"[1, 2]", None),
    ("completions", "rejection", {"model": "gpt-4", "prompt": "ab"}, "model"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "max_tokens": "ten"}, "max_tokens"),
    ("completions", "rejection", {"model": "rejection", "prompt": 3.5}, "prompt"),
    ("completions", "rejection", {"model": "rejection", "prompt": [1, 2.0]}, "prompt"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "temperature": "hot"}, "temperature"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "n": 2.0}, "n"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "stream": "yes"}, "stream"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "max_tokens": 0}, "max_tokens"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "max_tokens": -3}, "max_tokens"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "max_tokens": 10**6}, "max_tokens"),
    ("completions", "rejection", {"model": "rejection", "prompt": [7] * 17000, "max_tokens": 1}, "prompt"),
    ("completions", "rejection", {"model": "rejection", "prompt": [1, 500]}, "prompt"),
    ("completions", "rejection", {"model": "rejection", "prompt": ""}, "prompt"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "top_p": 0}, "top_p"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "stop": [""]}, "stop"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "particles": 2}, "particles"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "return_particles": True}, "return_particles"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "logprobs": 1}, "logprobs"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "echo": True}, "echo"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "best_of": 2}, "best_of"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "max_token": 5}, "max_token"),
    ("completions", "rejection", {"model": "rejection", "prompt": "ab", "n": 300}, "n"),
    ("completions", "smc", {"model": "smc", "prompt": "ab", "temperature": 0}, "temperature"),
    ("chat/completions", "rejection", {"model": "rejection", "messages": "hi"}, "messages"),
    ("chat/completions", "rejection", {"model": "rejection", "messages": []}, "messages"),
    ("chat/completions", "rejection", {"model": "rejection", "messages": [{"content": "x"}]}, "messages"),
    (
        "chat/completions",
        "rejection",
        {"model": "rejection", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
        "max_completion_tokens",
    ),  # fmt: skip
    (
        "chat/completions",
        "rejection",
        {"model": "rejection", "messages": [{"role": "user", "content": "x"}], "logprobs": True},
        "logprobs",
    ),  # fmt: skip
]


@pytest.mark.parametrize("endpoint, top, body, param", BAD, ids=[f"{c[3]}-{i}" for i, c in enumerate(BAD)])
def test_bad_requests_are_400s_in_openais_shape_naming_the_field(servers, endpoint, top, body, param):
    url = f"{servers[top]}/v1/{endpoint}"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, None)
    assert error["message"].startswith(param) if param else error["message"]


def test_several_prompts_times_n_are_the_choices_of_one_generate_call(servers, decoders):
    """prompt [p, q] with n = 2: choices p, p, q, q with the streams derive_seed(seed, 0..3), as generate gives."""
    decoder = decoders["rejection"]
    body = {"model": "rejection", "prompt": ["ab", "cd"], "n": 2, "seed": 9, "max_tokens": 10, "stop": "b"}
    answer = httpx.post(f"{servers['rejection']}/v1/completions", json=body, timeout=60).json()
    ab, cd = (decoder.tokenizer(text)["input_ids"] for text in ("ab", "cd"))
    expected = decoder.generate([ab, ab, cd, cd], seed=9, max_new_tokens=10, stop=["b"])
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
        (k, r.text, r.finish_reason) for k, r in enumerate(expected)
    ]
    assert answer["usage"]["prompt_tokens"] == len(ab) + len(cd)


def test_json_has_null_where_a_log_weight_is_infinite():
    """A particle whose proposal left the target's support weighs -inf; JSON has no such number."""
    particle = Particle([5], "x", -math.inf, "length")
    result = Result(
        "x", [5], "length", {"seconds": 1.0, "first_token_seconds": 0.5}, SMCOutcome([particle], 0, math.nan, 0)
    )
    body = CompletionFormat("m").body([result], [extension(result, True)], usage(3, [result]))
    choice = json.loads(body.model_dump_json(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))["choices"][0]
    assert choice["hsmc"]["log_z"] is None and choice["hsmc"]["particles"][0]["log_weight"] is None


# -- streaming and the extension field -----------------------------------------------------------------------------
def test_smc_stream_sends_the_consensus_and_ends_with_every_particle(servers, decoders):
    """n = 2 streamed choices of an smc top: each one's text is its particles' consensus as it settles, joining to
    generate's output; the final chunk carries log Ẑ, the resamplings, the chosen particle and all N particles."""
    decoder = decoders["smc"]
    body = {"model": "smc", "prompt": "hello", "max_tokens": 24, "seed": 5, "n": 2, "stream": True}
    with httpx.stream("POST", f"{servers['smc']}/v1/completions", json={**body, "return_particles": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    expected = decoder.generate([decoder.tokenizer("hello")["input_ids"]] * 2, seed=5, max_new_tokens=24)
    for j, result in enumerate(expected):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == j]
        assert "".join(c["text"] for c in mine) == result.text
        assert all(c["finish_reason"] is None for c in mine[:-1])
        streamed = [t for c in mine[:-1] for t in c["hsmc"]["token_ids"]]  # the consensus tokens, as they settled
        assert streamed == result.token_ids[: len(streamed)]
        last = mine[-1]
        assert last["hsmc"]["token_ids"] == result.token_ids
        assert last["finish_reason"] == result.finish_reason
        ext = last["hsmc"]
        assert ext["chosen"] == result.smc.chosen and ext["resamplings"] == result.smc.resamplings
        assert ext["log_z"] == pytest.approx(result.smc.log_z, rel=1e-4)
        assert ext["levels"][1]["kind"] == "smc" and 0 < ext["levels"][1]["mean_ess_fraction"] <= 1
        assert ext["seconds"] >= ext["first_token_seconds"] > 0
        particles = ext["particles"]
        assert len(particles) == 3 and particles[ext["chosen"]]["text"] == result.text
        for mine_p, theirs in zip(particles, result.smc.particles):
            assert (mine_p["token_ids"], mine_p["text"], mine_p["finish_reason"]) == (
                theirs.token_ids, theirs.text, theirs.finish_reason,
            )  # fmt: skip
    wait_idle(decoder)


# -- reliability ---------------------------------------------------------------------------------------------------
def test_a_client_that_disconnects_cancels_its_request(servers, decoders):
    """Streamed or not, a request whose client leaves is cancelled: its rows and KV slots are free again."""
    decoder, base = decoders["rejection"], servers["rejection"]
    wait_idle(decoder)  # so that "running rows" below counts this test's request alone
    cancelled = metric(base, 'hsmc_requests_total{status="cancelled"}')
    # runs for minutes (16000 tokens took over 300 s here), yet twice in CI under load it was no longer running when
    # its first chunk was read, cause unknown: a failure now says what the stream carried next
    body = {"model": "rejection", "prompt": "abc", "max_tokens": 16000, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        first = json.loads(line.removeprefix("data: "))
        running = decoder.driver.running_rows  # running, not failed or ended (then what the stream said after)
        if "error" in first or running != 1:
            rest = [line for line, _ in zip(lines, range(6)) if line]
            pytest.fail(f"first chunk {json.dumps(first)}, running rows {running}, then: {rest}")
    wait_idle(decoder)

    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
        sock.sendall(f"{head}{len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 20
        while decoder.driver.running_rows == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    wait_idle(decoder)
    assert metric(base, 'hsmc_requests_total{status="cancelled"}') == cancelled + 2


def test_a_full_queue_answers_429_and_every_accepted_request_completes(configs):
    """One row, a queue of 2, 12 requests at once: some get 429 with Retry-After, every accepted one completes."""
    decoder = HierarchicalDecoder.from_config(configs["rejection"], ["engine.max_batch_rows=1"])
    try:
        with live_server(create_app(decoder, "tiny", max_queue=2)) as base:
            body = {"model": "tiny", "prompt": "abc", "max_tokens": 30, "ignore_eos": True}
            start = threading.Barrier(12)

            def post(i: int) -> httpx.Response:
                start.wait()
                return httpx.post(f"{base}/v1/completions", json={**body, "seed": i}, timeout=60)

            with ThreadPoolExecutor(12) as pool:
                responses = list(pool.map(post, range(12)))
            codes = [r.status_code for r in responses]
            assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
            for r in responses:
                if r.status_code == 429:
                    assert r.headers["retry-after"] == "1" and "queue is full" in r.json()["error"]["message"]
                else:
                    assert r.json()["usage"]["completion_tokens"] == 30
            assert metric(base, 'hsmc_requests_total{status="rejected"}') == codes.count(429)
        wait_idle(decoder)
    finally:
        decoder.close()


def test_a_request_failing_in_the_engine_fails_alone(servers, decoders, monkeypatch):
    """A request whose stop check raises gets a 500 (an error event when streamed) with the message; the requests
    decoding beside it finish as `generate` decodes them, and no slot stays held."""
    decoder, base = decoders["rejection"], servers["rejection"]
    append = StopCriteria.append

    def failing(self, generated, new, max_new_tokens):
        if "qq" in self.strings:
            raise RuntimeError("injected failure")
        return append(self, generated, new, max_new_tokens)

    monkeypatch.setattr(StopCriteria, "append", failing)
    errors = metric(base, 'hsmc_requests_total{status="error"}')
    body = {"model": "rejection", "prompt": "abc", "max_tokens": 40, "ignore_eos": True}
    good = [{**body, "seed": s, "stop": ["zz"]} for s in range(6)]

    def post(request: dict) -> httpx.Response:
        return httpx.post(f"{base}/v1/completions", json=request, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        bad = pool.submit(post, {**body, "stop": ["qq"]})
        bad_stream = pool.submit(post, {**body, "stop": ["qq"], "stream": True})
        answers = list(pool.map(post, good))
    assert bad.result().status_code == 500
    assert bad.result().json()["error"] == {
        "message": "the request failed in the engine: injected failure", "type": "server_error", "param": None,
        "code": None,
    }  # fmt: skip
    events = [line for line in bad_stream.result().text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2][6:])["error"]["message"].endswith("injected failure") and events[-1] == "data: [DONE]"
    ids = decoder.tokenizer("abc")["input_ids"]
    expected = decoder.generate([ids] * 6, params=[SamplingParams(max_tokens=40, seed=derive_seed(s, 0), stop=("zz",),
                                                                  ignore_eos=True) for s in range(6)])  # fmt: skip
    assert [a.json()["choices"][0]["text"] for a in answers] == [r.text for r in expected]
    assert metric(base, 'hsmc_requests_total{status="error"}') == errors + 2
    wait_idle(decoder)


def test_models_health_and_metrics(servers):
    for top, level in (("rejection", "hsmc_accepted_length"), ("smc", "hsmc_ess_fraction")):
        base = servers[top]
        assert httpx.get(f"{base}/v1/models").json()["data"][0] == {
            "id": top, "object": "model", "created": pytest.approx(time.time(), abs=600), "owned_by": "hsmc",
        }  # fmt: skip
        ok = metric(base, 'hsmc_requests_total{status="ok"}')
        httpx.post(f"{base}/v1/completions", json={"model": top, "prompt": "abcd", "max_tokens": 8}, timeout=60)
        assert httpx.get(f"{base}/health").json() == {
            "status": "ok", "queue_depth": 0, "running_rows": 0, "kv_slots_in_use": 0,
        }  # fmt: skip
        text = httpx.get(f"{base}/metrics").text
        assert metric(base, 'hsmc_requests_total{status="ok"}') == ok + 1
        assert metric(base, "hsmc_prompt_tokens_total") >= 4 and metric(base, "hsmc_generation_tokens_total") >= 1
        assert metric(base, "hsmc_queue_depth") == 0 and metric(base, "hsmc_running_rows") == 0
        assert metric(base, "hsmc_time_to_first_token_seconds_count") >= 1
        assert "hsmc_time_per_output_token_seconds_bucket" in text
        assert metric(base, f'{level}_count{{level="1"}}') >= 1
