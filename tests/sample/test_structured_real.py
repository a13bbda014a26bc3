"""The issue's bar on the real default model (SmolLM2-135M-Instruct): 50 requests over several schemas
(nested objects, enums, arrays, required fields) through the real `openai` SDK's `chat.completions.parse`,
streamed and not, all valid and schema-conforming."""

from __future__ import annotations

import enum
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

from tiny_server import serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402


class Mood(str, enum.Enum):
    happy = "happy"
    sad = "sad"
    neutral = "neutral"


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    mood: Mood
    home: City


class ShoppingList(BaseModel):
    items: list[Annotated[str, Field(max_length=12)]] = Field(min_length=1, max_length=3)
    urgent: bool


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)
    sentiment: Mood
    tags: list[Mood] = Field(max_length=2)


CASES = [(Person, "Describe a person who lives in {x}."), (ShoppingList, "Make a short shopping list for {x}."),
         (Review, "Review a restaurant in {x}."), (City, "Name a city near {x}.")]
PLACES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Rome", "Quito", "Seoul", "Delhi", "Perth", "Boston", "Accra",
          "Bern"]


@pytest.mark.slow
def test_fifty_requests_over_four_schemas_all_valid(loaded):
    model, tokenizer = loaded
    generator = paged_hf.wrap(model, tokenizer, num_blocks=256, max_num_seqs=25).generator
    requests = [(CASES[i % 4][0], CASES[i % 4][1].format(x=PLACES[i % len(PLACES)]), i % 2 == 1) for i in range(50)]
    with serving(create_app(generator, tokenizer, "smol", ServerSettings())) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

        def ask(request):
            schema, question, stream = request
            kwargs = dict(model="smol", messages=[{"role": "user", "content": question}], response_format=schema,
                          max_tokens=128, temperature=0)
            if stream:
                with client.chat.completions.stream(**kwargs) as events:
                    return events.get_final_completion().choices[0]
            return client.chat.completions.parse(**kwargs).choices[0]

        with ThreadPoolExecutor(25) as pool:
            choices = list(pool.map(ask, requests))
    bad = [(r[0].__name__, c.finish_reason, c.message.content) for r, c in zip(requests, choices)
           if not isinstance(c.message.parsed, r[0])]
    assert not bad, f"{len(bad)} of 50 invalid: {bad[:3]}"
