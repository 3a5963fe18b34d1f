"""The decoder in a process of its own, so that `hsmc serve`'s HTTP front end and the decode loop do not share a GIL.

In one process every request parse and every streamed event took the GIL from the decode thread, and its eager
prefills took it from the event loop in turn: on an H100, 16 streaming clients of the 8B got 0.82-0.92x the
in-process throughput and their first tokens up to 90 ms after the engine had them
(docs/measurements/2026-11-27-h100-serve-bench.txt). vLLM and SGLang split their API servers from their engines
for the same reason. `EngineProcess` offers the app what a `HierarchicalDecoder` does (`tokenizer`, `config`,
`vocab_size`, `is_smc`, `driver.submit` / `cancel`, the counters, `kv_slots_in_use`, `close`); the child builds the
decoder (its warmup included), runs the request driver, and sends each burst of increments in one message.
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from hsmc.config import HsmcConfig
from hsmc.errors import HsmcError
from hsmc.requests import Increment, SamplingParams

Sink = Callable[[Increment], None]


class EngineProcess:
    """A decoder served from a spawned child process; built once its config has passed the preflight checks and its
    models are loaded and warmed up. This process imports no torch."""

    def __init__(self, config: HsmcConfig) -> None:
        """Raises the child's own error (e.g. a ModelLoadError naming the level) when the decoder cannot be built."""
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_engine_main, args=(config, child), name="hsmc-engine", daemon=True)
        self._process.start()
        child.close()
        try:
            kind, *payload = self._conn.recv()  # the child loads and warms up meanwhile
        except EOFError:
            self._process.join()
            code = self._process.exitcode
            raise HsmcError(f"serve: the engine process exited while loading (exit code {code})") from None
        if kind == "failed":
            self._process.join()
            raise payload[0]
        self.tokenizer, self.vocab_size, self.is_smc = payload
        self.config = config
        self._send_lock = threading.Lock()
        self._sinks: dict[int, tuple[Sink, set[int]]] = {}  # submission -> (its sink, its choices not ended)
        self._replies: dict[int, Future] = {}
        self._numbers = itertools.count()
        self._status = (0, 0)  # (queue depth, running rows) as of the engine's last message
        threading.Thread(target=self._receive, name="hsmc-engine-receiver", daemon=True).start()

    @property
    def driver(self) -> EngineProcess:
        return self

    @property
    def queue_depth(self) -> int:
        return self._status[0]

    @property
    def running_rows(self) -> int:
        return self._status[1]

    def submit(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        sink: Sink,
        indices: Sequence[int],
    ) -> list[int]:
        """As `RequestDriver.submit` (its RequestError raised here); the sink runs on this process's receiver thread."""
        submission = next(self._numbers)
        self._sinks[submission] = (sink, set(indices))
        try:
            return self._call("submit", submission, list(prompts), list(params), list(indices))
        except BaseException:
            self._sinks.pop(submission, None)
            raise

    def cancel(self, request_ids: Sequence[int]) -> None:
        self._send(("cancel", None, list(request_ids)))

    def kv_slots_in_use(self) -> int:
        """One round trip, which also brings the queue depth and running rows up to date."""
        slots, self._status = self._call("kv_slots_in_use")
        return slots

    def close(self, timeout: float = 0.0) -> None:
        """Let running requests finish for `timeout` seconds, cancel the rest (their last increments arrive first),
        and stop the child."""
        if self._process.is_alive():
            self._call("close", timeout)
        self._process.join()

    def _call(self, name: str, *args: Any) -> Any:
        number = next(self._numbers)
        reply: Future = Future()
        self._replies[number] = reply
        self._send((name, number, *args))
        return reply.result()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _receive(self) -> None:
        """Hand each increment to its submission's sink and each reply to its caller, until the child is gone."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "increments":
                _, increments, self._status = message
                for submission, increment in increments:
                    sink, running = self._sinks[submission]
                    sink(increment)
                    if increment.result is not None or increment.error is not None:
                        running.discard(increment.index)
                        if not running:
                            del self._sinks[submission]
            else:
                _, number, ok, value = message
                reply = self._replies.pop(number)
                reply.set_result(value) if ok else reply.set_exception(value)
        gone = HsmcError(f"the engine process exited (exit code {self._process.exitcode})")
        for reply in self._replies.values():
            reply.set_exception(gone)
        for sink, running in list(self._sinks.values()):
            for index in running:
                sink(Increment(index, [], "", error=gone))


class _Outbox:
    """Increments posted by the driver's thread, sent in one message per burst by a thread of their own."""

    def __init__(self, conn: Connection, send_lock: threading.Lock, status: Callable[[], tuple[int, int]]) -> None:
        self._conn, self._send_lock, self._status = conn, send_lock, status
        self._posted: list[tuple[int, Increment]] = []
        self._sending = False
        self._changed = threading.Condition()
        threading.Thread(target=self._send_forever, name="hsmc-engine-outbox", daemon=True).start()

    def post(self, submission: int, increment: Increment) -> None:
        if increment.error is not None:
            increment.error = _picklable(increment.error)
        with self._changed:
            self._posted.append((submission, increment))
            self._changed.notify_all()

    def flush(self) -> None:
        """Return once everything posted so far has been sent."""
        with self._changed:
            self._changed.wait_for(lambda: not self._posted and not self._sending)

    def _send_forever(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._posted)
                posted, self._posted, self._sending = self._posted, [], True
            try:
                with self._send_lock:
                    self._conn.send(("increments", posted, self._status()))
            except OSError:  # the front end is gone
                return
            finally:
                with self._changed:
                    self._sending = False
                    self._changed.notify_all()


def _picklable(error: BaseException) -> BaseException:
    """The error itself if it crosses the pipe intact, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _engine_main(config: HsmcConfig, conn: Connection) -> None:
    """The child: build the decoder, then serve the front end's calls until it closes or goes away."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C reaches the whole process group: the front end stops us
        signal.signal(sig, signal.SIG_IGN)
    from hsmc.decoder import HierarchicalDecoder
    from hsmc.errors import KVCapacityError
    from hsmc.preflight import check_before_loading

    try:
        try:  # the levels' files and the stop strings, before minutes of loading
            check_before_loading(config, [[0]])
        except KVCapacityError as e:
            raise KVCapacityError(f"serve: a one-token prompt with generation.max_new_tokens does not fit: {e}") from e
        decoder = HierarchicalDecoder(config)
    except BaseException as e:
        conn.send(("failed", _picklable(e)))
        return
    conn.send(("ready", decoder.tokenizer, decoder.vocab_size, decoder.is_smc))
    driver, send_lock = decoder.driver, threading.Lock()
    status = lambda: (driver.queue_depth, driver.running_rows)  # noqa: E731
    outbox = _Outbox(conn, send_lock, status)
    while True:
        try:
            name, number, *args = conn.recv()
        except (EOFError, OSError):  # the front end is gone: nobody waits for the running requests
            decoder.close(0.0)
            return
        try:
            if name == "submit":
                submission, prompts, params, indices = args
                value: Any = driver.submit(prompts, params, partial(outbox.post, submission), indices=indices)
            elif name == "cancel":
                value = driver.cancel(*args)
            elif name == "kv_slots_in_use":
                value = decoder.kv_slots_in_use(), status()
            else:  # close
                decoder.close(*args)
                outbox.flush()
                value = None
            ok = True
        except Exception as e:
            ok, value = False, _picklable(e)
        if number is not None:
            with send_lock:
                conn.send(("reply", number, ok, value))
        if name == "close":
            return
