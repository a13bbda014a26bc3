"""Replicas of `paged-hf serve` on Ray Serve, behind one endpoint, routed by prefix and adapter.

See launch.py for the ways to start it and docs/scaling.md for when to. Importing this package needs Ray
only for `build_app` (Ray Serve's application builder).
"""

from __future__ import annotations


def build_app(config: dict):
    """Ray Serve's application builder: see `paged_hf.serving.ray.launch.build_app`."""
    from paged_hf.serving.ray.launch import build_app as build  # noqa: PLC0415

    return build(config)
