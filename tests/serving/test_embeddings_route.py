"""`POST /v1/embeddings` through the real `openai` SDK against a real server: equal to sentence-transformers'
`encode` of the same model folder, base64 (the SDK's default) and float, `dimensions`, token-id inputs, errors."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import transformers

pytest.importorskip("fastapi")
pytest.importorskip("sentence_transformers")
openai = pytest.importorskip("openai")

from conftest import assert_no_leak  # noqa: E402
from embedding_models import TEXTS, save_embedding_model  # noqa: E402
from tiny_server import serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import create_app  # noqa: E402

MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("st") / "mean"
    oracle = save_embedding_model(folder, "mean")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    generator = paged_hf.wrap(model, tokenizer, num_blocks=64, max_num_batched_tokens=32, max_model_len=64).generator
    with serving(create_app(generator, tokenizer, MODEL)) as url:
        yield url, oracle.encode(TEXTS), tokenizer
    assert_no_leak(generator)


def test_openai_sdk_embeddings(server):
    url, expected, tokenizer = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    answer = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(np.array([d.embedding for d in answer.data]), expected, atol=1e-5)
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == num_tokens and answer.model == MODEL
    short = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=8, encoding_format="float")
    truncated = torch.nn.functional.normalize(torch.tensor(expected[1, :8]), dim=0).numpy()
    np.testing.assert_allclose(short.data[0].embedding, truncated, atol=1e-5)
    ids = client.embeddings.create(model=MODEL, input=[tokenizer(TEXTS[2])["input_ids"]], encoding_format="float")
    np.testing.assert_allclose(ids.data[0].embedding, expected[2], atol=1e-5)


def test_bad_embedding_requests(server):
    url = server[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    for kwargs, field in [({"dimensions": 65}, "dimensions"), ({"dimensions": 0}, "dimensions"),
                          ({"input": ""}, "input"), ({"input": "the " * 70}, "max_model_len")]:
        with pytest.raises(openai.BadRequestError, match=field):
            client.embeddings.create(**{"model": MODEL, "input": "the", **kwargs})
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="the")
    answer = httpx.post(url + "/v1/embeddings", json={"input": "the", "encoding_format": "int8"}, timeout=30)
    assert answer.status_code == 400 and "encoding_format" in answer.text
    answer = httpx.post(url + "/v1/embeddings", json={"input": "the", "truncate": 3}, timeout=30)
    assert answer.status_code == 400 and "truncate" in answer.text
