"""Build the Ray Serve application (an ingress and N engine replicas) and run it.

    paged-hf serve --replicas 2 [serve flags]          # starts a local Ray (or joins --ray-address)
    serve run paged_hf.entrypoints.ray_serve:build_app serve_args="--model PATH --num-blocks 512" replicas=2
    serve run examples/ray_serve.yaml                  # the same as a Ray Serve config file

Ray Serve's application builder (`build_app`, which parses `paged-hf serve` flags) is the command line's:
paged_hf/entrypoints/ray_serve.py.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading

from paged_hf.config import PagedConfig
from paged_hf.loader.default_model import DEFAULT_MODEL, ensure_default_checkpoint, is_default_model
from paged_hf.serving.assembly import API_KEY_ENV_VAR, default_served_name, read_chat_template

#: the deployment that holds the engines (the router registers under this name)
ENGINE_DEPLOYMENT = "PagedEngine"


def build_application(args: argparse.Namespace):
    """The Ray Serve application for resolved `paged-hf serve` flags (`args.replicas` replicas; the engine's
    PagedConfig keyword arguments in `args.engine_config`)."""
    # optional dependencies, imported only when replicas are asked for: ray (these modules import it), fastapi
    from ray import serve  # noqa: PLC0415 - optional dependency
    from ray.serve.config import RequestRouterConfig  # noqa: PLC0415

    from paged_hf.serving.openai import ServerSettings  # noqa: PLC0415
    from paged_hf.serving.openai.api_keys import read_api_key_file  # noqa: PLC0415
    from paged_hf.serving.ray.ingress import Ingress  # noqa: PLC0415
    from paged_hf.serving.ray.replica import EngineReplica  # noqa: PLC0415
    from paged_hf.serving.ray.router import PagedRequestRouter  # noqa: PLC0415

    serve_args = {k: v for k, v in vars(args).items() if k not in ("func", "argv")}
    serve_args.update(replicas=0, tensor_parallel_size=1)  # a replica serves plainly
    router = RequestRouterConfig(request_router_class=PagedRequestRouter,
                                 request_router_kwargs={"policy": args.routing},
                                 request_routing_stats_period_s=1, request_routing_stats_timeout_s=5)
    engines = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        num_replicas=args.replicas, max_ongoing_requests=max(1, min(args.max_queue, 4096)),
        ray_actor_options={"num_cpus": args.num_cpus_per_replica, "num_gpus": args.num_gpus_per_replica},
        request_router_config=router, health_check_period_s=5, health_check_timeout_s=60)
    tokenizer_path = str(ensure_default_checkpoint()) if is_default_model(args.model) else args.model
    names = args.served_model_name or [default_served_name(args.model or DEFAULT_MODEL)]
    ingress = serve.deployment(Ingress, name="PagedIngress").options(
        num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
    block_size = args.block_size or PagedConfig().block_size
    return ingress.bind(engines.bind(serve_args), ENGINE_DEPLOYMENT, tokenizer_path, names, block_size,
                        read_chat_template(args.chat_template), args.tool_call_parser,
                        ServerSettings(api_key=args.api_key or os.environ.get(API_KEY_ENV_VAR) or None,
                                       api_keys=read_api_key_file(getattr(args, "api_key_file", None)),
                                       max_body_bytes=args.max_body_bytes,
                                       trust_request_chat_template=args.trust_request_chat_template))


def serve_replicas(args: argparse.Namespace) -> int:
    """`paged-hf serve --replicas N`: run the application on Ray Serve until SIGINT/SIGTERM."""
    try:
        import ray  # noqa: PLC0415 - optional dependency (the "ray" extra)
        from ray import serve  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise ValueError(f"--replicas needs Ray Serve (pip install 'paged-hf[ray]'): {exc}") from None
    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        start_local_ray(max(1, math.ceil(args.replicas * args.num_cpus_per_replica)))
    try:
        start_serve(args.host, args.port)
        serve.run(build_application(args), name="paged_hf", route_prefix="/")
        print(f"paged-hf serve: {args.replicas} replicas on http://{args.host}:{args.port}/v1 (Ray Serve, routing "
              f"{args.routing})", file=sys.stderr, flush=True)
        _wait_for_signal()
    finally:
        stop_ray()
    return 0


def start_local_ray(num_cpus: int, **init_kwargs) -> None:
    """A small local Ray: only the CPUs the replicas ask for, no dashboard. Ray Serve's controller kills a proxy
    that does not answer its ready check within 5 s: on a busy machine that is too short."""
    import ray  # noqa: PLC0415 - optional dependency (the "ray" extra)

    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(name, "300")  # read by Ray's processes, which inherit this environment
    ray.init(num_cpus=num_cpus, include_dashboard=False, **init_kwargs)


def start_serve(host: str, port: int) -> None:
    """Ray Serve with its HTTP proxy on host:port. serve.start gives up on the proxy after 60 s, which a busy
    machine can take just to start a worker process; the proxy keeps starting, so connect again and go on."""
    import ray  # noqa: PLC0415 - optional dependency (the "ray" extra)
    from ray import serve  # noqa: PLC0415 - optional dependency

    try:
        serve.start(http_options={"host": host, "port": port})
    except (TimeoutError, ray.exceptions.RayActorError):
        print("paged-hf serve: Ray Serve's HTTP proxy is slow to start; waiting for it", file=sys.stderr, flush=True)
        serve.start(http_options={"host": host, "port": port})


def stop_ray(timeout_s: float = 60) -> None:
    """serve.shutdown (the replicas drain), at most `timeout_s` (it may wait on a proxy that never came up),
    then ray.shutdown (a local Ray's processes end with it)."""
    import ray  # noqa: PLC0415 - optional dependency (the "ray" extra)
    from ray import serve  # noqa: PLC0415 - optional dependency

    stopper = threading.Thread(target=serve.shutdown, daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    ray.shutdown()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
