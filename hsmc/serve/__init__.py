"""`hsmc serve`: an OpenAI-compatible HTTP API (completions, chat completions, streaming) over one decoder.

`app.create_app` builds the FastAPI app on the decoder's request driver, which batches every client's requests
continuously; `server.serve` runs it under uvicorn. Importing this package imports FastAPI, so the CLI does it only
inside the subcommand.
"""

from hsmc.serve.app import create_app

__all__ = ["create_app"]
