"""`paged-hf eval-ppl`: the strided windows, the engine's perplexity against plain HF's, and the command."""

from __future__ import annotations

import json

import pytest
from conftest import random_prompts, real_tokenizer, tiny_model, tiny_model_for

from paged_hf.entrypoints.cli import main
from paged_hf.entrypoints.eval_ppl import engine_perplexity, hf_nll, perplexity, stdlib_docstrings, windows


@pytest.mark.parametrize("num_tokens, context_len, stride", [(100, 16, 15), (100, 16, 5), (17, 16, 8), (2, 4, 3),
                                                              (50, 50, 1), (40, 2, 1)])
def test_windows_score_every_token_but_the_first_once(num_tokens, context_len, stride):
    scored = []
    for w in windows(num_tokens, context_len, stride):
        assert 0 < w.end - w.begin <= context_len and 0 < w.num_scored < w.end - w.begin  # the first has no context
        assert w.num_scored <= max(stride, context_len - 1)
        scored += range(w.end - w.num_scored, w.end)
    assert scored == list(range(1, num_tokens))


@pytest.mark.parametrize("args, message", [((10, 1, 1), "context_len"), ((10, 8, 8), "stride"),
                                           ((10, 8, 0), "stride"), ((1, 8, 4), "at least 2")])
def test_bad_windows_are_value_errors(args, message):
    with pytest.raises(ValueError, match=message):
        windows(*args)


def test_engine_perplexity_equals_plain_hf_for_auto_and_stays_close_for_int8():
    """float64 tiny model, chunked prefill (a budget below the window) and overlapping windows."""
    model = tiny_model("llama")
    ids = random_prompts([300], seed=7)[0]
    reference = perplexity(hf_nll(model, ids, windows(len(ids), 64, 24)))
    config = dict(block_size=4, max_num_batched_tokens=40)
    auto = engine_perplexity(model, ids, 64, 24, **config)
    assert auto == pytest.approx(reference, rel=1e-9)
    for kv_cache_dtype in ("int8", "fp8_e4m3"):
        quantized = engine_perplexity(model, ids, 64, 24, kv_cache_dtype=kv_cache_dtype, **config)
        assert quantized != auto and quantized == pytest.approx(reference, rel=0.01)


def test_the_builtin_corpus_is_long_enough():
    assert len(stdlib_docstrings()) > 250_000  # ~4 characters a token: the 50k tokens of a real evaluation


def test_eval_ppl_command(tmp_path, capsys):
    tokenizer = real_tokenizer()
    folder = tmp_path / "tiny"
    tiny_model_for(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = tmp_path / "text.txt"
    text.write_text(stdlib_docstrings()[:1500])
    assert main(["eval-ppl", "--model", str(folder), "--dtype", "float32", "--text", str(text), "--context-len", "64",
                 "--stride", "32", "--kv-cache-dtypes", "auto,int8", "--block-size", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_scored"] == result["num_tokens"] - 1 > 200
    ppl = result["perplexity"]
    assert set(ppl) == {"auto", "int8", "hf"}
    assert ppl["auto"] == pytest.approx(ppl["hf"], rel=1e-4)  # float32
    assert ppl["int8"] == pytest.approx(ppl["auto"], rel=0.02)
    assert main(["eval-ppl", "--model", str(folder), "--text", str(text), "--stride", "2000"]) == 2  # a ValueError
    assert "stride" in capsys.readouterr().err
