"""The import path of releases before the layered layout: the code lives in `paged_hf.loader`."""

from paged_hf.loader.default_model import DEFAULT_MODEL, ensure_default_checkpoint, is_default_model, load_model

__all__ = ["DEFAULT_MODEL", "ensure_default_checkpoint", "is_default_model", "load_model"]
