"""Response bodies and stream chunks of the two endpoints, which differ only in their wire shapes; the `hsmc`
extension field that every finished choice carries."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel

from hsmc.requests import Result
from hsmc.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    Usage,
)


def extension(result: Result, return_particles: bool) -> dict[str, Any]:
    """The choice's `hsmc` field: its token ids, per-level statistics and timings, and an smc top's particle system
    (log Ẑ, resamplings, the chosen particle; every particle with `return_particles`)."""
    out: dict[str, Any] = {
        "token_ids": result.token_ids,
        "levels": result.levels,
        "seconds": result.stats["seconds"],
        "first_token_seconds": result.stats["first_token_seconds"],
    }
    smc = result.smc
    if smc is not None:
        out.update(log_z=smc.log_z, resamplings=smc.resamplings, chosen=smc.chosen)
        if return_particles:
            out["particles"] = [
                {"text": p.text, "token_ids": p.token_ids, "log_weight": p.log_weight, "finish_reason": p.finish_reason}
                for p in smc.particles
            ]
    return out


def usage(prompt_tokens: int, results: list[Result]) -> Usage:
    completion = sum(len(r.token_ids) for r in results)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def sse(body: BaseModel | str) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`)."""
    return f"data: {body if isinstance(body, str) else body.model_dump_json()}\n\n"


class CompletionFormat:
    """/v1/completions: `text_completion` objects, streamed as a sequence of them."""

    prefix = "cmpl"

    def __init__(self, model: str) -> None:
        self.id, self.created, self.model = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time()), model

    def body(self, results: list[Result], extensions: list[dict[str, Any]], use: Usage) -> BaseModel:
        choices = [
            CompletionChoice(index=k, text=r.text, finish_reason=r.finish_reason, hsmc=ext)
            for k, (r, ext) in enumerate(zip(results, extensions))
        ]
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=use)

    def opening(self, index: int) -> BaseModel | None:
        """The chunk a choice's stream starts with, if any."""
        return None

    def text(self, index: int, text: str, token_ids: list[int]) -> BaseModel:
        """A piece of settled output: its text, and its token ids in the `hsmc` field (a model without a tokenizer
        streams ids alone)."""
        return self._chunk([CompletionChoice(index=index, text=text, hsmc={"token_ids": token_ids})])

    def closing(self, index: int, finish_reason: str, ext: dict[str, Any]) -> BaseModel:
        return self._chunk([CompletionChoice(index=index, text="", finish_reason=finish_reason, hsmc=ext)])

    def usage(self, use: Usage) -> BaseModel:
        return self._chunk([], use)

    def _chunk(self, choices: list[CompletionChoice], use: Usage | None = None) -> BaseModel:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=use)


class ChatFormat(CompletionFormat):
    """/v1/chat/completions: a `chat.completion`, or `chat.completion.chunk`s whose first delta gives the role."""

    prefix = "chatcmpl"

    def body(self, results: list[Result], extensions: list[dict[str, Any]], use: Usage) -> BaseModel:
        choices = [
            ChatChoice(index=k, message=AssistantMessage(content=r.text), finish_reason=r.finish_reason, hsmc=ext)
            for k, (r, ext) in enumerate(zip(results, extensions))
        ]
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=use)

    def opening(self, index: int) -> BaseModel | None:
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])

    def text(self, index: int, text: str, token_ids: list[int]) -> BaseModel:
        delta = Delta(content=text)
        return self._chunk([ChatChunkChoice(index=index, delta=delta, hsmc={"token_ids": token_ids})])

    def closing(self, index: int, finish_reason: str, ext: dict[str, Any]) -> BaseModel:
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish_reason, hsmc=ext)])

    def _chunk(self, choices: list[ChatChunkChoice], use: Usage | None = None) -> BaseModel:  # type: ignore[override]
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=use)
