"""`paged-hf bench` with the pipeline systems on the real default model (float32): `paged_hf_pp2` and
`paged_hf_pp3` (micro-batches in flight) and `paged_hf_pp2_serial` (one batch at a time) give HF's greedy tokens,
and each stage holds its part of the layers, weights and KV blocks."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from paged_hf.bench.pipeline import is_pipeline_system

from test_bench import _entry_point  # noqa: E402 - the same `paged-hf` entry point


def test_pipeline_system_names():
    assert all(map(is_pipeline_system, ("paged_hf_pp2", "paged_hf_pp3_serial", "paged_hf_pp9")))
    assert not any(map(is_pipeline_system, ("paged_hf", "paged_hf_pp1", "paged_hf_pp2_fast", "paged_hf_pp10")))


@pytest.mark.slow
def test_pipeline_systems_give_hf_greedy_tokens_with_their_share_of_the_model(tmp_path, converted):
    systems = ["hf_static_8", "paged_hf", "paged_hf_pp2", "paged_hf_pp2_serial", "paged_hf_pp3"]
    command = [*_entry_point(), "bench", "--workload", "mixed", "--requests", "6", "--max-new-tokens-scale", "0.05",
               "--systems", ",".join(systems), "--out", str(tmp_path), "--num-blocks", "96", "--no-machine-limit"]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PAGED_HF_CACHE=str(Path(converted[0]).parent)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "bench_mixed.json").read_text())["systems"]
    for name in systems[1:]:
        assert report[name]["outputs_vs_reference"]["identical"] == 6, (name, report[name])
    whole = report["paged_hf"]["extra"]
    for name, stages, layers in (("paged_hf_pp2", 2, [0, 16]), ("paged_hf_pp3", 3, [0, 11])):  # the head weighs 2
        memory = report[name]["extra"]["memory"]
        assert memory["stage0_layers"] == layers and len(memory["rss_bytes"]) == stages
        assert memory["num_blocks"] == whole["num_blocks"] == 96  # the same blocks, each of fewer layers
        assert report[name]["extra"]["batches_in_flight"] == stages
    assert report["paged_hf_pp2_serial"]["extra"]["batches_in_flight"] == 1
