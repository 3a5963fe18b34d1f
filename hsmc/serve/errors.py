"""Every failure answered in OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`, so that clients
(the `openai` package among them) surface the message; a bad request is a 400 naming its field, never a 422 or a
500 with a traceback."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from hsmc.errors import RequestError
from hsmc.serve.protocol import ErrorBody, ErrorDetail


class ApiError(Exception):
    """A request that ends in an error response; `outcome` is how the requests metric counts it."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        outcome: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.outcome = outcome or ("rejected" if status < 500 else "error")
        self.headers = headers

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.kind, param=self.param))

    def response(self) -> Response:
        return Response(self.body().model_dump_json(), self.status, self.headers, media_type="application/json")


def bad_request(message: str, param: str | None) -> ApiError:
    """A 400 whose message starts with the field it is about (the engine's messages may name a config key)."""
    named = param is None or message.startswith(param)
    return ApiError(400, message if named else f"{param}: {message}", param)


def from_request_error(error: RequestError, limit_field: str = "max_tokens") -> ApiError:
    """The engine refused a request: its field (`max_tokens` as the client named it), or, without one, the
    driver is shutting down."""
    if error.field is None:
        return ApiError(503, f"{error}", kind="server_error", outcome="rejected")
    return bad_request(str(error), limit_field if error.field == "max_tokens" else error.field)


def _validation_error(error: RequestValidationError) -> ApiError:
    """The first problem pydantic found, named by its path in the body (`messages.0.content`)."""
    first = error.errors()[0]
    loc = [str(part) for part in first.get("loc", ())][1:]  # after "body"
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc:
        return ApiError(400, f"the body must be a JSON object: {first['msg']}")
    if first.get("type") == "extra_forbidden":
        return bad_request(f"{'.'.join(loc)}: unknown field (not an OpenAI parameter hsmc serve takes)", loc[0])
    return bad_request(f"{'.'.join(loc)}: {first['msg']}", loc[0])


def install_handlers(app: FastAPI, count: Callable[[str], None]) -> None:
    """Answer every error in OpenAI's shape; `count(outcome)` is told of each failed completion request."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> Response:
        count(error.outcome)
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> Response:
        return await api_error(request, _validation_error(error))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return ApiError(error.status_code, str(error.detail), headers=error.headers).response()

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> Response:  # Starlette logs the traceback
        return await api_error(request, ApiError(500, f"internal error: {error}", kind="server_error"))
