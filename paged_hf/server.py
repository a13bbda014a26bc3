"""The import path of releases before the layered layout: the server lives in `paged_hf.serving.openai`."""

from paged_hf.serving.openai import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
