"""lm-evaluation-harness's `local-completions` model against our server, as its users run MMLU or HellaSwag:
batched token-id prompts with `echo=True, logprobs=1, max_tokens=1`. The loglikelihoods it reports for a small
task read from a local file equal HF's own (one forward of the same tokens) to 1e-4, on the real default model
in float32."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("lm_eval")

from tiny_server import serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402

DOCS = [
    {"context": "The capital of France is", "continuation": " Paris"},
    {"context": "The capital of France is", "continuation": " Berlin"},
    {"context": "Water boils at a temperature of", "continuation": " 100 degrees Celsius"},
    {"context": "def add(a, b):\n    return", "continuation": " a + b"},
    {"context": "One, two, three,", "continuation": " four, five"},
    {"context": "The quick brown fox", "continuation": " jumps over the lazy dog"},
]

TASK = """task: paged_hf_local_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
"""


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """As lm-eval splits it: the continuation's tokens are those of context + continuation past the context's."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    num_context = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return sum(logprobs[p - 1, whole[p]].item() for p in range(num_context, len(whole)))


@pytest.mark.slow
def test_lm_eval_local_completions_loglikelihoods_equal_hf(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval  # noqa: PLC0415
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    model, tokenizer = loaded
    assert next(model.parameters()).dtype == torch.float32
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=tmp_path / "docs.jsonl"))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    generator = paged_hf.wrap(model, tokenizer, num_blocks=64, max_num_batched_tokens=16).generator
    app = create_app(generator, tokenizer, "smol", ServerSettings())
    with serving(app) as url:
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=["paged_hf_local_ll"], log_samples=True,
            model_args=f"model=smol,base_url={url}/v1/completions,tokenizer={tmp_path / 'tokenizer'},"
                       "num_concurrent=1,max_retries=1,batch_size=3", bootstrap_iters=0,
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))  # not its 10k tasks
    samples = sorted(results["samples"]["paged_hf_local_ll"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    for sample in samples:
        doc = DOCS[sample["doc_id"]]
        got, _ = sample["resps"][0][0]
        assert got == pytest.approx(hf_loglikelihood(model, tokenizer, doc["context"], doc["continuation"]), abs=1e-4)
    assert samples[0]["resps"][0][0][0] > samples[1]["resps"][0][0][0]  # Paris over Berlin
