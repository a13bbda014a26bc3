"""The import path of releases before the layered layout (`serve run paged_hf.ray_serve:build_app`): Ray
Serve's application builder lives in `paged_hf.entrypoints.ray_serve`."""

from paged_hf.entrypoints.ray_serve import build_app

__all__ = ["build_app"]
