"""transformers' tensor parallelism (tp_plan="auto") under torchrun with gloo: rank 0 equals single-process HF."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import hf_greedy, random_prompts, tiny_model


def test_two_ranks_match_single_process_hf_and_never_diverge(tmp_path):
    model = tiny_model("llama")  # 4 heads, 2 KV heads: one KV head per rank
    model.save_pretrained(tmp_path / "model")
    prompts = random_prompts([7, 15, 11])
    expected = [hf_greedy(model, p, 6) for p in prompts]
    out_file = tmp_path / "out.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    script = Path(__file__).resolve().parents[1] / "scripts" / "tp_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path / "model"),
               json.dumps(prompts), str(out_file)]
    # its own session, so a hung rank is killed with torchrun instead of outliving the test
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output.decode()[-3000:]
    result = json.loads(out_file.read_text())
    assert result["kv_heads"] == [1, 1]  # each rank's cache holds its share of the KV heads
    assert result["greedy"] == expected
    rank0, rank1 = result["sampled"]
    assert rank0 == rank1  # differently seeded ranks still append rank 0's tokens
    assert len(set(result["num_blocks"])) == 1  # budgets differed per rank, the pool sizes agree
