"""`paged-hf bench --workload tenants` end to end on a tiny model (seconds): every run (B alone, fcfs, fair,
priority) reports both tenants' TTFT/TPOT percentiles and does exactly the same work, in each of two rounds."""

from __future__ import annotations

import json

from serve_process import save_tiny_model

from paged_hf.bench.tenants import RUNS, arrivals, build_tenants
from paged_hf.entrypoints import cli


def test_tenants_bench_reports_each_tenant_under_each_policy(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    code = cli.main(["bench", "--workload", "tenants", "--model", folder, "--requests", "8", "--num-blocks", "256",
                     "--max-num-seqs", "4", "--max-new-tokens-scale", "0.1", "--threads", "1", "--rounds", "2",
                     "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| fair | B | 2 |" in table and "| priority | A | 8 |" in table  # a round's requests
    assert "fair: B's TTFT p99 " in table and "2 rounds, the runs taking turns" in table
    report = json.loads((out / "tenants_bench.json").read_text())
    assert list(report["runs"]) == [name for name, _ in RUNS]
    assert set(report["runs"]["B alone"]["tenants"]) == {"B"}
    for name in ("fcfs", "fair", "priority"):
        run = report["runs"][name]
        assert run["tenants"]["A"]["tokens"] == 8 * 13 and run["tenants"]["B"]["tokens"] == 2 * 2  # EOS ignored
        for tenant in ("A", "B"):
            ttft = run["tenants"][tenant]["ttft_s"]
            assert 0 < ttft["p50"] <= ttft["p99"]
        assert len(run["walls_s"]) == len(run["rounds_tok_s"]) == 2 and run["wall_s"] == sum(run["walls_s"]) / 2
        assert run["tok_s"] == sum(run["rounds_tok_s"]) / 2  # the median of two
        assert len(run["tenants"]["B"]["rounds_ttft_p99_s"]) == 2 and min(run["tenants"]["B"]["rounds_ttft_p99_s"]) > 0
        assert run["tok_s"] > 0
        assert (run["paced_steps"] is None) == (name == "fcfs")


def test_the_arrival_plan_of_each_policy():
    from tiny_server import tiny_tokenizer

    workload = build_tenants(tiny_tokenizer(), num_a=3, num_b=4, a_prompt_tokens=64, a_new_tokens=5, b_new_tokens=2)
    plan = arrivals(workload, with_a=True, policy="priority")
    assert [(a.tenant, a.at, a.priority) for a in plan] == [("A", 0.0, 0)] * 3 + [
        ("B", i * 0.2, -1) for i in range(4)]
    assert {a.priority for a in arrivals(workload, with_a=True, policy="fair")} == {0}
    assert {a.tenant for a in arrivals(workload, with_a=False, policy="fcfs")} == {"B"}
