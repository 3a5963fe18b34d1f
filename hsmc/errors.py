"""Every error hsmc reports to a user, in one place.

`HsmcError` is the base of the errors caused by the user's input (a config key, a file, a model,
a prompt, the KV budget): the CLI prints them as one line `hsmc: error: ...` and exits 2. Anything
else is a bug in hsmc or a library and keeps its traceback.
"""

from __future__ import annotations


class HsmcError(Exception):
    """A problem with the user's input; the message names the file, key, level or prompt at fault."""


class ConfigError(HsmcError, ValueError):
    """An invalid configuration; the message names the key."""


class ModelLoadError(HsmcError, ValueError):
    """A model could not be found or read; the message names the source and what is wrong.

    `source` is the level's `model` string when known, so the decoder can name the level(s) using it.
    """

    def __init__(self, message: str, source: str | None = None) -> None:
        super().__init__(message)
        self.source = source


class UnsupportedArchitectureError(ModelLoadError):
    """The config names a model family or feature the decoder does not implement."""


class ChecksumError(HsmcError, RuntimeError):
    """A downloaded or cached asset does not have the published sha256."""


class KVCapacityError(HsmcError, RuntimeError):
    """A request needs more KV slots than the engine was given (`engine.kv_capacity_tokens`)."""


class PromptError(HsmcError, ValueError):
    """A prompt cannot be decoded (empty, text without a tokenizer, too long)."""


class RequestError(HsmcError, ValueError):
    """A request's parameters or prompt cannot be served; `field` names the parameter at fault (the server's 400)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class RequestCancelled(HsmcError):
    """The request was cancelled (by its caller, a disconnected client, or a shutdown) before it finished."""
