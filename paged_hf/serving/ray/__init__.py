"""Replicas of `paged-hf serve` on Ray Serve, behind one endpoint, routed by prefix and adapter.

See launch.py for the ways to start it and docs/scaling.md for when to. Ray Serve's application builder, which
parses `paged-hf serve` flags, is the command line's: `paged_hf.entrypoints.ray_serve:build_app`.
"""
