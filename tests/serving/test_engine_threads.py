"""The server's engine thread owns torch's intra-op threads (`reserve_torch_threads`): with the main thread on
one thread, libgomp keeps the engine's workers spinning between parallel regions instead of sleeping on a
futex after ~100 spins, which made `paged-hf serve` decode at 0.7x of offline on 2 cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import asyncio, resource, sys, torch, transformers
import paged_hf
from paged_hf.serving.openai.engine_loop import EngineLoop, reserve_torch_threads
from paged_hf.serving.openai.metrics import ServerMetrics

reserved = sys.argv[1] == "reserve"
num_threads = reserve_torch_threads() if reserved else None
a = torch.randn(384, 384)
a @ a  # the main thread's own torch work (model loading, in the server)

def matmuls(_):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(3000):
        a @ a  # one parallel region each
    return torch.get_num_threads(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before

async def main():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    generator = paged_hf.wrap(transformers.LlamaForCausalLM(config).eval(), num_blocks=8).generator
    engine = EngineLoop(generator, ServerMetrics(), num_threads=num_threads)
    engine.start()
    try:
        return await engine.call(matmuls)
    finally:
        engine.stop()

threads, switches = asyncio.run(main())
print(torch.get_num_threads(), threads, switches)
"""


def run(mode: str) -> tuple[int, int, int]:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    main_threads, engine_threads, switches = map(int, out.stdout.split())
    return main_threads, engine_threads, switches


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: torch runs one thread, there is no team to throttle")
def test_the_engine_thread_gets_torchs_threads_and_its_workers_do_not_sleep_between_regions():
    main_threads, engine_threads, switches = run("reserve")
    assert (main_threads, engine_threads) == (1, 2)
    # 3000 parallel regions: the worker spins between them (a handful of switches, from other processes);
    # throttled, it sleeps on a futex for nearly every one (measured: ~3000)
    assert switches < 300, switches

