"""`paged-hf proxy`: one OpenAI endpoint in front of prefill and decode instances (docs/disaggregated.md).

    paged-hf proxy --prefill http://p1:8100 --decode http://d1:8200 [--decode http://d2:8200] [--port 8000]
"""

from __future__ import annotations

import argparse


def cmd_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until interrupted. Imported here: fastapi, uvicorn and httpx are optional."""
    import uvicorn  # noqa: PLC0415 - the 'serve' extra

    from paged_hf.serving.proxy import ProxySettings, create_proxy_app  # noqa: PLC0415 - as above

    settings = ProxySettings(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
                             prefill_threshold_tokens=args.prefill_threshold_tokens,
                             on_prefill_failure=args.on_prefill_failure, api_key=args.api_key,
                             max_body_bytes=args.max_body_bytes)
    uvicorn.Server(uvicorn.Config(create_proxy_app(settings), host=args.host, port=args.port,
                                  log_level=args.log_level)).run()
    return 0


def add_proxy_parser(sub) -> None:
    """The `proxy` subcommand of `paged-hf`."""
    proxy = sub.add_parser("proxy", help="route requests through prefill and decode instances (disaggregated)")
    proxy.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="a prefill instance (paged-hf serve --kv-transfer-config ... kv_producer); repeatable, "
                       "taken in turn; none: every request goes to a decode instance (a round-robin balancer)")
    proxy.add_argument("--decode", action="append", required=True, metavar="URL",
                       help="a decode instance (kv_consumer); repeatable, taken in turn")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument("--prefill-threshold-tokens", type=int, default=256, metavar="N",
                       help="prompts of fewer than N tokens go straight to decode (default: 256)")
    proxy.add_argument("--on-prefill-failure", choices=("recompute", "fail"), default="recompute",
                       help="when a prefill instance fails: decode computes the prompt itself (recompute, "
                       "default) or the client gets a 503 (fail)")
    proxy.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' of clients (all routes but /health); the header "
                       "is forwarded to the instances either way")
    proxy.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413 "
                       "(default: 4 MiB, as paged-hf serve's)")
    proxy.add_argument("--log-level", default="info", help="uvicorn log level")
    # the proxy loads no model: what `paged-hf`'s main resolves for every command, given so it has nothing to do
    proxy.set_defaults(func=cmd_proxy, model=None, device="cpu", dtype="float32")
