"""The FastAPI app of `hsmc serve`: OpenAI's completions and chat completions over a decoder's request driver, which
batches every HTTP request's choices continuously with the others, plus the model list, health and metrics.

Every request's choices are cancelled as soon as nobody waits for them (the client left, the request failed, the
server shuts down), so their rows and KV slots go back to the pool at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from hsmc import __version__
from hsmc.errors import RequestCancelled, RequestError
from hsmc.requests import Result
from hsmc.serve.bridge import Submission
from hsmc.serve.errors import ApiError, bad_request, from_request_error, install_handlers
from hsmc.serve.inputs import chat_prompt, choice_params, completion_prompts
from hsmc.serve.metrics import ServerMetrics
from hsmc.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from hsmc.serve.responses import ChatFormat, CompletionFormat, extension, sse, usage

logger = logging.getLogger("hsmc.serve")

DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streamed request checks that its client is still there


def create_app(decoder: Any, served_model_name: str, max_queue: int) -> FastAPI:
    """The app for `decoder` (a `HierarchicalDecoder`), answering to `served_model_name`; a request whose choices
    would take the driver's queue (submitted, not admitted yet) past `max_queue` gets a 429."""
    service = _Service(decoder, served_model_name, max_queue)
    app = FastAPI(title="hsmc", version=__version__)
    install_handlers(app, service.metrics.requests_by)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        service.check_model(body)
        prompts = completion_prompts(decoder.tokenizer, body)
        return await service.complete(request, body, prompts, CompletionFormat(served_model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        service.check_model(body)
        prompts = [chat_prompt(decoder.tokenizer, body)]
        return await service.complete(request, body, prompts, ChatFormat(served_model_name))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": served_model_name, "object": "model", "created": service.created, "owned_by": "hsmc"}
        return {"object": "list", "data": [model]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        slots = await asyncio.to_thread(decoder.kv_slots_in_use)  # a read of the device: off the event loop
        driver = service.driver
        return {
            "status": "ok",
            "queue_depth": driver.queue_depth,
            "running_rows": driver.running_rows,
            "kv_slots_in_use": slots,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(service.driver), media_type=service.metrics.content_type)

    return app


class _Service:
    def __init__(self, decoder: Any, served_model_name: str, max_queue: int) -> None:
        self.decoder, self.name, self.max_queue = decoder, served_model_name, max_queue
        self.driver = decoder.driver
        self.vocab = decoder.vocab_size
        self.created = int(time.time())
        self.metrics = ServerMetrics()

    def check_model(self, body: SamplingRequest) -> None:
        if body.model != self.name:
            raise bad_request(f"model {body.model!r} is not served here; this server serves {self.name!r}", "model")

    async def complete(
        self, request: Request, body: SamplingRequest, prompts: list[list[int]], fmt: CompletionFormat
    ) -> Response:
        """Submit every choice and answer with their results, or stream them as they settle."""
        choices, params = choice_params(body, prompts, self.decoder.config.generation, self.vocab)
        if body.return_particles and not self.decoder.is_smc:
            raise bad_request("only an smc top level has particles", "return_particles")
        if len(choices) > self.max_queue:
            raise bad_request(f"{len(choices)} choices are more than this server queues (--max-queue)", "n")
        waiting = self.driver.queue_depth
        if waiting + len(choices) > self.max_queue:
            raise ApiError(
                429, f"the queue is full ({waiting} requests wait for rows); retry later", kind="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )  # fmt: skip
        try:
            submission = Submission(self.driver, choices, params)
        except RequestError as e:
            raise from_request_error(e, body.token_limit[0]) from None
        prompt_tokens = sum(map(len, prompts))
        self.metrics.prompt_tokens.inc(prompt_tokens)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._events(submission, len(choices), body.return_particles, fmt, prompt_tokens, include_usage)
            return _EventStream(events, submission, self.metrics)
        try:
            results = await self._results(request, submission)
        except asyncio.CancelledError:  # the server gave up on the request (shutdown)
            self.metrics.requests_by("cancelled")
            raise
        finally:
            submission.cancel()
        self.metrics.requests_by("ok")
        extensions = [extension(r, body.return_particles) for r in results]
        answer = fmt.body(results, extensions, usage(prompt_tokens, results))
        return Response(answer.model_dump_json(), media_type="application/json")

    async def _results(self, request: Request, submission: Submission) -> list[Result]:
        """Every choice's result, in order; an ApiError when one fails or the client disconnects."""
        results: dict[int, Result] = {}
        check = time.monotonic() + DISCONNECT_POLL_SECONDS
        while submission.open:
            try:
                increment = await asyncio.wait_for(submission.next(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                increment = None
            if time.monotonic() >= check:  # increments come at every step: the check goes by the clock
                check = time.monotonic() + DISCONNECT_POLL_SECONDS
                if await request.is_disconnected():
                    raise ApiError(499, "the client disconnected", outcome="cancelled")
            if increment is None:
                continue
            if increment.error is not None:
                raise _failure(increment.error)
            if increment.result is not None:
                results[increment.index] = increment.result
                self.metrics.finished(increment.result)
        return [results[k] for k in range(len(results))]

    async def _events(
        self,
        submission: Submission,
        choices: int,
        return_particles: bool,
        fmt: CompletionFormat,
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: each choice's text as it settles, its finish reason and `hsmc` field when it ends,
        the usage if asked for, then [DONE]; a failure is an `error` event."""
        for k in range(choices):
            opening = fmt.opening(k)
            if opening is not None:
                yield sse(opening)
        results, failure = [], None
        while submission.open and failure is None:
            increment = await submission.next()
            if increment.error is not None:
                submission.cancel()
                failure = _failure(increment.error)
                continue
            if increment.token_ids:
                yield sse(fmt.text(increment.index, increment.text, increment.token_ids))
            result = increment.result
            if result is not None:
                self.metrics.finished(result)
                results.append(result)
                yield sse(fmt.closing(increment.index, result.finish_reason, extension(result, return_particles)))
        if failure is not None:
            self.metrics.requests_by(failure.outcome)
            yield sse(failure.body())
        else:
            self.metrics.requests_by("ok")
            if include_usage:
                yield sse(fmt.usage(usage(prompt_tokens, results)))
        yield sse("[DONE]")


class _EventStream(StreamingResponse):
    """A streamed completion: however its stream ends (the last choice, the client leaving, the server giving up on
    it), the choices still running are cancelled."""

    def __init__(self, events: AsyncIterator[str], submission: Submission, metrics: ServerMetrics) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.submission, self.metrics = submission, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.submission.open:
                self.submission.cancel()
                self.metrics.requests_by("cancelled")


def _failure(error: BaseException) -> ApiError:
    """The error response of a choice the driver ended early: cancelled (a shutdown), or failed in the engine."""
    if isinstance(error, RequestCancelled):
        return ApiError(503, f"the request was cancelled: {error}", kind="server_error", outcome="cancelled")
    logger.error("a request failed in the engine", exc_info=error)
    return ApiError(500, f"the request failed in the engine: {error}", kind="server_error")
