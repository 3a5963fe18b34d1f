"""The OpenAI wire format `hsmc serve` speaks: request bodies (validated strictly, so a wrong type is a 400 naming
the field, not a silent coercion) and response bodies, chunks and errors.

Responses serialize -inf / nan (an smc particle's log-weight after its proposal left the target's support) as null,
since JSON has no such numbers.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError


def _one_of(forms: str) -> WrapValidator:
    """A union's error in one line ("must be a string or a list of strings"), not one per member."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "must be {forms}", {"forms": forms}) from None

    return WrapValidator(validate)


Stop = Annotated[str | list[str], _one_of("a string or a list of strings")]
Prompt = Annotated[
    str | list[int] | list[str] | list[list[int]],
    _one_of("a string, a list of token ids, or a list of strings or of token-id lists"),
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields both endpoints take; an unknown field is refused (a misspelt parameter should not pass unnoticed)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: int | None = None
    stop: Stop | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's own endpoint may log it
    particles: int | None = None  # extension: an smc top's N
    ignore_eos: bool | None = None  # extension
    return_particles: bool = False  # extension: every particle of an smc top in the `hsmc` field

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        return next((f for f in ("presence_penalty", "frequency_penalty", "logit_bias") if getattr(self, f)), None)

    @property
    def token_limit(self) -> tuple[str, int | None]:
        """(the field that set the output length, its value)."""
        return "max_tokens", self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.logprobs is not None:
            return "logprobs"
        if self.echo:
            return "echo"
        if self.best_of is not None and self.best_of > 1:
            return "best_of"
        return super().unsupported()

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts, one or several: a string or a list of token ids is one."""
        prompt = self.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return [prompt]  # type: ignore[list-item]
        return prompt  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: str
    text: str


class ChatMessage(BaseModel):
    """A message as the chat template receives it; extra keys (name, tool_calls, ...) are passed on to it."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: Annotated[str | list[TextPart], _one_of("a string or a list of text parts")] | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"
        if self.top_logprobs is not None:
            return "top_logprobs"
        return super().unsupported()

    @property
    def token_limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


# -- responses --------------------------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="null")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None
    hsmc: dict[str, Any] | None = None  # the extension: level statistics, an smc top's particle system


class _Envelope(_Response):
    """What every response body and chunk starts with."""

    id: str
    created: int
    model: str


class Completion(_Envelope):
    object: str = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Delta(_Response):
    role: str | None = None
    content: str | None = None


class AssistantMessage(_Response):
    role: str = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None
    hsmc: dict[str, Any] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None
    hsmc: dict[str, Any] | None = None


class ChatCompletion(_Envelope):
    object: str = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Envelope):
    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(_Response):
    error: ErrorDetail
