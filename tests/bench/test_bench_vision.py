"""`paged-hf bench --workload vision` at the tiny shape: both systems run every request on the same images, the
same tokens (float32, one process), and the two-turn chat's second turn hits paged_hf's prefix cache."""

from __future__ import annotations

import json

from paged_hf.bench.vision import chat_text, vision_requests
from paged_hf.entrypoints import cli


def test_vision_bench_runs_both_systems_on_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["bench", "--workload", "vision", "--vision-shape", "tiny", "--requests", "3",
                     "--max-new-tokens-scale", "0.125", "--threads", "1", "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    report = json.loads((out / "bench_vision.json").read_text())
    work = report["workload"]
    assert work["num_requests"] == 3 and work["num_images"] == 4 and work["max_new_tokens"] == 8
    assert report["requests_with_equal_tokens"] == 3
    for name in ("hf_generate", "paged_hf"):
        figures = report["systems"][name]
        assert f"| {name} |" in table and figures["new_tokens"] == 3 * 8 and figures["new_tokens_per_s"] > 0
    chat = report["systems"]["paged_hf"]["two_turn_chat"]
    assert chat["turn_2_prefix_hit_tokens"] >= 16 and 0 < chat["turn_2_prefix_hit_rate"] <= 1  # the image's blocks
    assert report["systems"]["paged_hf"]["vs_hf_generate"] == report["systems"]["paged_hf"]["new_tokens_per_s"] / \
        report["systems"]["hf_generate"]["new_tokens_per_s"]


def test_vision_requests_are_seeded_with_one_or_two_images():
    first, again = vision_requests("tiny", 6, 4, seed=1), vision_requests("tiny", 6, 4, seed=1)
    assert [len(r.images) for r in first] == [1, 1, 2, 1, 1, 2]
    assert all(a.images[0].tobytes() == b.images[0].tobytes() for a, b in zip(first, again))
    assert first[2].text == chat_text(first[2].text.split("<image><image>")[1].split("<end")[0], 2)
