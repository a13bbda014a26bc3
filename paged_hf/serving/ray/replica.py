"""`EngineReplica`: one Ray Serve replica = one engine and `paged-hf serve`'s own app around it.

The ingress forwards each HTTP request as an `HttpCall`; the replica runs it through the app in-process
(`call_asgi`) and streams the response back, its first item saying which replica answered. Ray polls
`record_routing_stats()` for the router: which adapters this replica has loaded and which are resident on
its device.
"""

from __future__ import annotations

import argparse

from ray import serve

from paged_hf.serving.assembly import build_app, load_engine
from paged_hf.serving.openai.engine_loop import reserve_torch_threads
from paged_hf.serving.openai.memory import freeze_startup_objects
from paged_hf.serving.ray.asgi import HttpCall, call_asgi


class EngineReplica:
    def __init__(self, serve_args: dict):
        """`serve_args`: the resolved `paged-hf serve` flags (with `engine_config`), as a dict."""
        args = argparse.Namespace(**serve_args)
        engine_threads = reserve_torch_threads()  # the engine thread computes, as in `paged-hf serve`
        model, tokenizer, generator = load_engine(args)
        self.generator = generator
        self.app = build_app(args, model, tokenizer, generator, engine_threads)
        self.engine = self.app.state.ctx.engine
        freeze_startup_objects()  # what the app's lifespan does behind uvicorn
        self.engine.start()
        self.name = serve.get_replica_context().replica_id.unique_id

    async def handle(self, call: HttpCall, routing=None):
        """Stream the app's response to `call`: {"status", "headers", "replica"} first, then body chunks.
        `routing` is for the router only (see router.py)."""
        async for item in call_asgi(self.app, call):
            if isinstance(item, dict):
                item["replica"] = self.name
            yield item

    def record_routing_stats(self) -> dict:
        resident = self.generator.resident_adapter_names()  # read off the engine thread: a snapshot may lag a step
        return {"adapters": list(self.engine.adapter_names), "resident_adapters": resident,
                "num_in_flight": self.engine.num_in_flight}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
