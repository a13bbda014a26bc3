"""OpenAI-compatible HTTP server (`paged-hf serve`): FastAPI routes in front of one engine thread.

Imported lazily by the CLI: fastapi and uvicorn are the optional `serve` extra, not engine dependencies.
"""

from paged_hf.serving.openai.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
