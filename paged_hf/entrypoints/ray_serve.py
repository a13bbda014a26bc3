"""Ray Serve's application builder for `paged-hf serve` replicas (see docs/scaling.md):

    serve run paged_hf.entrypoints.ray_serve:build_app serve_args="--model PATH --num-blocks 512" replicas=2
    serve run examples/ray_serve.yaml    # a config file whose import_path names this builder

It parses `paged-hf serve`'s own flags, so it lives with the command line; the application it returns is
paged_hf.serving.ray.launch's, as `paged-hf serve --replicas N` runs it.
"""

from __future__ import annotations

import shlex

from paged_hf.entrypoints.cli import build_parser
from paged_hf.entrypoints.cli_args import engine_config, resolve_model_args
from paged_hf.serving.ray.launch import build_application


def build_app(config: dict):
    """Ray Serve's application builder (`serve run ...:build_app ...` or a config file's `import_path`):
    `serve_args` (the `paged-hf serve` flags, a string or a list), `replicas`, `routing`."""
    flags = config.get("serve_args", [])
    flags = shlex.split(flags) if isinstance(flags, str) else [str(flag) for flag in flags]
    args = build_parser().parse_args(["serve", *flags, "--replicas", str(config.get("replicas", 1)),
                                      "--routing", str(config.get("routing", "prefix"))])
    resolve_model_args(args)
    args.engine_config = engine_config(args)  # as `paged-hf serve` sets it for the server's assembly
    return build_application(args)
