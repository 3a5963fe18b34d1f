"""`hsmc serve` under uvicorn, and its clean stop: on SIGTERM or Ctrl-C the server stops listening, gives the
running requests `shutdown_timeout` seconds to finish, cancels the rest (their clients get an error, not a cut
connection) and returns, so the process exits 0."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from hsmc.serve.app import create_app

DRAIN_SECONDS = 5.0  # once the decoder has stopped: the most time the last responses get to reach their clients


class _Server(uvicorn.Server):
    """uvicorn's server; its shutdown stops the decoder (finish, then cancel) before the connections are drained."""

    def __init__(self, config: uvicorn.Config, decoder: Any, timeout: float) -> None:
        super().__init__(config)
        self.decoder, self.timeout = decoder, timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while the running requests finish
        logging.getLogger("uvicorn.error").info("Stopped listening; running requests get %gs to finish", self.timeout)
        await asyncio.to_thread(self.decoder.close, self.timeout)
        await super().shutdown(sockets)


def serve(decoder: Any, served_model_name: str, host: str, port: int, max_queue: int, shutdown_timeout: float) -> None:
    """Serve `decoder` on host:port until SIGTERM or Ctrl-C."""
    decoder.warmup(progress=True)
    app = create_app(decoder, served_model_name, max_queue)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=DRAIN_SECONDS, log_level="info")
    server = _Server(config, decoder, shutdown_timeout)
    # uvicorn raises the signal it stopped for again once it is done, under the handlers it found: these ignore it
    previous = {sig: signal.signal(sig, _handled) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _handled(sig: int, frame: FrameType | None) -> None:
    """The shutdown that answered this signal is over."""
