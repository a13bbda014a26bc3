"""`paged-hf bench --workload embed` end to end on a tiny model: the sentence-transformers folder is made by
sentence-transformers itself (last-token pooling, Normalize) in the cache folder, and `paged-hf serve`'s
/v1/embeddings, `LLM.embed` and `SentenceTransformer.encode` give the same vectors for the same texts."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sentence_transformers")

from serve_process import save_tiny_model  # noqa: E402

from paged_hf.bench.embed import EMBED_SYSTEMS, embed_texts, parse_embed_systems  # noqa: E402
from paged_hf.entrypoints import cli  # noqa: E402
from paged_hf.loader.pooling_config import read_pooling_config  # noqa: E402
from paged_hf.utils import CACHE_ENV_VAR  # noqa: E402


def test_embed_bench_runs_every_system_on_the_same_vectors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))  # the workers and the server inherit it
    model = save_tiny_model(tmp_path / "model")  # a plain HF folder whose tokenizer has a chat template
    out = tmp_path / "out"
    code = cli.main(["bench", "--workload", "embed", "--model", model, "--requests", "6", "--concurrency", "2",
                     "--threads", "1", "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    report = json.loads((out / "bench_embed.json").read_text())
    folder = report["settings"]["folder"]
    assert folder.startswith(str(tmp_path / "cache")) and read_pooling_config(folder).pooling_type == "lasttoken"
    assert read_pooling_config(folder).normalize
    assert report["reference_system"] == "sentence_transformers" and list(report["systems"]) == list(EMBED_SYSTEMS)
    assert report["workload"]["num_texts"] == 6
    # every timed run computes every text: the runs after the first would otherwise read them from the cache
    assert report["settings"]["engine_config"]["enable_prefix_caching"] is False
    for name, system in report["systems"].items():
        assert f"| {name} |" in table and system["texts_per_s"] > 0, name
        assert len(system["walls_s"]) == 3 and system["wall_s"] == min(system["walls_s"])
        agree = system["vectors_vs_reference"]
        assert agree["max_abs_diff"] < 1e-5 and agree["min_cosine"] > 1 - 1e-6, (name, agree)
        assert system["vs_sentence_transformers"] == pytest.approx(
            report["systems"]["sentence_transformers"]["wall_s"] / system["wall_s"])
    serve = report["systems"]["paged_hf_embed_serve"]["extra"]
    assert serve["num_requests"] == 2 and serve["texts_per_request"] == 4 and serve["concurrency"] == 2


def test_embed_texts_are_seeded_and_systems_checked():
    from tiny_server import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    texts = embed_texts(tokenizer, seed=3, num_texts=5)
    assert texts == embed_texts(tokenizer, seed=3, num_texts=5) != embed_texts(tokenizer, seed=4, num_texts=5)
    assert all(8 <= len(tokenizer(t, add_special_tokens=False)["input_ids"]) <= 48 for t in texts)
    assert parse_embed_systems("paged_hf_embed,paged_hf_embed") == ["paged_hf_embed"]
    with pytest.raises(ValueError, match="hf_static_8"):
        parse_embed_systems("hf_static_8")


def test_bad_embed_bench_arguments_are_one_line_errors(capsys):
    for flags in (["--concurrency", "0"], ["--requests", "-1"], ["--systems", "paged_hf"]):
        assert cli.main(["bench", "--workload", "embed", *flags]) == 2, flags
        assert capsys.readouterr().err.startswith("paged-hf bench: error:")
