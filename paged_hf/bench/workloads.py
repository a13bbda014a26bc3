"""Benchmark workloads: seeded lists of chat requests built from real text.

Why real text and a chat template: throughput of a chat model depends on prompt lengths, and prefix caching
depends on what the prompts share (the template's system preamble, a long system prompt). Random token ids
would exercise neither honestly. The text is the docstrings of Python's standard library, which every machine
has without downloads; the same seed on the same Python gives the same token ids.

Every request fixes its own output length (greedy, EOS ignored), so each system does exactly the same work and
"useful tokens" is the same number for all of them.
"""

from __future__ import annotations

import importlib
import inspect
import random
import warnings
from dataclasses import dataclass, field, replace

#: Standard-library modules whose docstrings make the corpus (fixed order: the corpus must not depend on
#: import order or on which modules happen to be loaded).
CORPUS_MODULES = (
    "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email.message", "enum", "fractions", "functools", "heapq", "inspect", "ipaddress",
    "json", "logging", "pathlib", "pickle", "pprint", "queue", "random", "shlex", "shutil", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest.case",
    "urllib.parse", "uuid", "zipfile",
)

INSTRUCTIONS = (
    "Summarize the following documentation.",
    "Explain the following documentation to a beginner.",
    "List the key points of the following documentation.",
    "Write a short tutorial based on the following documentation.",
    "What questions could a programmer ask about the following documentation?",
)

QUESTION_TEMPLATES = (
    "What does {name} do?",
    "When would I use {name}?",
    "Give a short example that uses {name}.",
    "Summarize {name} in one sentence.",
    "What are common mistakes with {name}?",
    "How does {name} differ from the alternatives?",
)

#: Adapter names of the lora workload (None = the base model). LoRA adapters are loaded by name into the engine.
LORA_ADAPTERS = ("lora_a", "lora_b", "lora_c", "lora_d")

WORKLOAD_NAMES = ("mixed", "prefix", "decode", "lora", "structured", "beam", "grounded", "tenants",  # tenants.py
                  "embed", "documents", "vision")  # embed.py, documents.py, vision.py

#: grounded requests: the answer restates, extracts from or edits the passage (what prompt lookup serves)
GROUNDED_INSTRUCTIONS = (
    "Repeat the following text exactly, word for word.",
    "Copy the following documentation, keeping every sentence as it is.",
    "Rewrite the following text with each sentence on its own line.",
    "Fix any typos in the following text and return the whole text.",
)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_new_tokens: int
    adapter: str | None = None
    schema: dict | None = None  # a JSON schema the output must follow (structured outputs)
    wave: int = 0  # requests of wave k + 1 arrive when those of wave k have finished (documents.py)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    seed: int
    requests: list[BenchRequest] = field(default_factory=list)
    num_beams: int = 1  # > 1: every system runs beam search of this width (EOS ignored, the best beam compared)
    num_blocks: int | None = None  # the engine's pool, when the workload sizes it (documents.py)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_new_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    @property
    def needs_adapters(self) -> bool:
        return any(r.adapter is not None for r in self.requests)

    def scaled(self, num_requests: int | None = None, max_new_tokens_scale: float | None = None) -> Workload:
        """The first ``num_requests`` requests (a quick run keeps the arrival order of the full one), with every
        ``max_new_tokens`` multiplied by ``max_new_tokens_scale`` (at least 1 token)."""
        requests = list(self.requests[:num_requests] if num_requests else self.requests)
        if max_new_tokens_scale is not None:
            if max_new_tokens_scale <= 0:
                raise ValueError(f"max_new_tokens_scale must be > 0, got {max_new_tokens_scale}")
            requests = [replace(r, max_new_tokens=max(1, round(r.max_new_tokens * max_new_tokens_scale)))
                        for r in requests]
        return replace(self, requests=requests)

    def summary(self) -> dict:
        prompt_lengths = [len(r.prompt_token_ids) for r in self.requests]
        new_lengths = [r.max_new_tokens for r in self.requests]
        return {
            "name": self.name, "description": self.description, "seed": self.seed,
            "num_requests": len(self.requests),
            "prompt_tokens": sum(prompt_lengths), "new_tokens": sum(new_lengths),
            "prompt_len_range": [min(prompt_lengths, default=0), max(prompt_lengths, default=0)],
            "new_len_range": [min(new_lengths, default=0), max(new_lengths, default=0)],
            "adapters": sorted({r.adapter for r in self.requests if r.adapter}), "num_beams": self.num_beams,
        }

    def to_json(self) -> dict:
        return {"name": self.name, "description": self.description, "seed": self.seed, "num_beams": self.num_beams,
                "requests": [[r.prompt_token_ids, r.max_new_tokens, r.adapter, r.schema, r.wave]
                             for r in self.requests]}

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        requests = [BenchRequest(list(p), int(m), a, *rest) for p, m, a, *rest in data["requests"]]
        return cls(data["name"], data["description"], int(data["seed"]), requests, int(data.get("num_beams", 1)))


# --- the corpus -----------------------------------------------------------------------------------------------

def module_docs(module_name: str) -> tuple[str, list[str]]:
    """(text, public names) of one module: its docstring followed by those of its public classes and functions
    defined in it, in name order so the text is the same however the module was imported."""
    module = importlib.import_module(module_name)
    parts = [inspect.getdoc(module) or ""]
    names = []
    with warnings.catch_warnings():  # reading e.g. typing.io's docstring warns that typing.io is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        members = sorted(vars(module).items())
        docs = {name: inspect.getdoc(obj) for name, obj in members}
    for name, obj in members:
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        doc = docs[name]
        if doc:
            parts.append(f"{name}: {doc}")
            names.append(f"{module_name}.{name}")
    return "\n\n".join(p for p in parts if p), names


def corpus_token_ids(tokenizer) -> list[int]:
    """All corpus modules' docs as one token stream (a request's passage is a window of it)."""
    text = "\n\n".join(f"# {name}\n\n{module_docs(name)[0]}" for name in CORPUS_MODULES)
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # longer than the context: fine


def chat_prompt(tokenizer, user: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": user})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def passage(tokenizer, corpus: list[int], num_tokens: int, rng: random.Random) -> str:
    """A window of ``num_tokens`` corpus tokens at a seeded offset, as text."""
    num_tokens = max(1, min(num_tokens, len(corpus)))
    start = rng.randrange(0, len(corpus) - num_tokens + 1)
    return tokenizer.decode(corpus[start:start + num_tokens])


# --- the workloads --------------------------------------------------------------------------------------------

def build_mixed(tokenizer, seed: int = 0, num_requests: int = 64, prompt_range=(16, 600), new_range=(16, 200),
                corpus: list[int] | None = None) -> Workload:
    """Chat requests of very different sizes: the case where static batches waste work on padding and waiting."""
    rng = random.Random(seed)
    corpus = corpus if corpus is not None else corpus_token_ids(tokenizer)
    overhead = len(chat_prompt(tokenizer, ""))
    requests = []
    for _ in range(num_requests):
        target = rng.randint(*prompt_range)
        instruction = rng.choice(INSTRUCTIONS)
        text_tokens = max(1, target - overhead - len(tokenizer(instruction, add_special_tokens=False)["input_ids"]))
        prompt = chat_prompt(tokenizer, f"{instruction}\n\n{passage(tokenizer, corpus, text_tokens, rng)}")
        requests.append(BenchRequest(prompt, rng.randint(*new_range)))
    return Workload("mixed", f"{num_requests} chat requests, prompts ~{prompt_range[0]}-{prompt_range[1]} tokens, "
                    f"{new_range[0]}-{new_range[1]} new tokens, greedy, EOS ignored", seed, requests)


def build_prefix(tokenizer, seed: int = 0, num_requests: int = 24, system_tokens: int = 800,
                 max_new_tokens: int = 32, corpus: list[int] | None = None) -> Workload:
    """One long shared system prompt, short distinct questions: what automatic prefix caching is for."""
    rng = random.Random(seed)
    corpus = corpus if corpus is not None else corpus_token_ids(tokenizer)
    system = passage(tokenizer, corpus, system_tokens, rng)
    names = [n for m in CORPUS_MODULES for n in module_docs(m)[1]]
    rng.shuffle(names)
    requests = []
    for i in range(num_requests):
        question = QUESTION_TEMPLATES[i % len(QUESTION_TEMPLATES)].format(name=names[i % len(names)])
        requests.append(BenchRequest(chat_prompt(tokenizer, question, system=system), max_new_tokens))
    return Workload("prefix", f"{num_requests} questions sharing a ~{system_tokens}-token system prompt, "
                    f"{max_new_tokens} new tokens each", seed, requests)


def build_decode(tokenizer, seed: int = 0, num_requests: int = 48, new_range=(128, 320)) -> Workload:
    """Short questions, long answers: decode-bound, where batching many sequences per step is everything."""
    rng = random.Random(seed)
    names = [n for m in CORPUS_MODULES for n in module_docs(m)[1]]
    requests = []
    for _ in range(num_requests):
        question = rng.choice(QUESTION_TEMPLATES).format(name=rng.choice(names))
        requests.append(BenchRequest(chat_prompt(tokenizer, question), rng.randint(*new_range)))
    return Workload("decode", f"{num_requests} short questions, {new_range[0]}-{new_range[1]} new tokens each",
                    seed, requests)


def build_lora(tokenizer, seed: int = 0, corpus: list[int] | None = None, num_adapters: int | None = None,
               random_adapters: bool = False, num_requests: int = 64) -> Workload:
    """The mixed workload with each request tagged with one of four adapters or the base model (multi-LoRA); with
    `num_adapters` N, request i on adapter `lora_{i % N}` (bench --adapters N: every request on an adapter), or on
    a random one of the N (`random_adapters`: many registered adapters, few of them twice)."""
    mixed = build_mixed(tokenizer, seed, num_requests, corpus=corpus)
    if num_adapters is not None:
        rng = random.Random(seed + 2)
        indices = [rng.randrange(num_adapters) if random_adapters else i % num_adapters for i in range(num_requests)]
        requests = [replace(r, adapter=f"lora_{index}") for r, index in zip(mixed.requests, indices)]
        how = f"a random one of {num_adapters} adapters" if random_adapters else f"adapter i % {num_adapters}"
        return Workload("lora", f"{num_requests} requests of the mixed kind, request i on {how}", seed, requests)
    rng = random.Random(seed + 1)
    choices = (*LORA_ADAPTERS, None)
    requests = [replace(r, adapter=rng.choice(choices)) for r in mixed.requests]
    return Workload("lora", f"the mixed workload, each request on one of {len(LORA_ADAPTERS)} adapters or the base "
                    "model", seed, requests)


def answer_schema(max_new_tokens: int) -> dict:
    """A JSON schema with an enum, a bounded integer and a free answer too long (minLength: 16 characters per
    token) to close before max_new_tokens: a request with it does exactly the work of one without."""
    return {"type": "object", "additionalProperties": False, "required": ["topic", "confidence", "answer"],
            "properties": {"topic": {"enum": ["api", "example", "pitfall", "other"]},
                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                           "answer": {"type": "string", "minLength": 16 * max_new_tokens}}}


def build_structured(tokenizer, seed: int = 0, num_requests: int = 64, new_range=(64, 128)) -> Workload:
    """The decode workload's kind of requests, every other one with a JSON schema: what grammar masking costs."""
    decode = build_decode(tokenizer, seed, num_requests, new_range)
    schema = answer_schema(new_range[1])  # one schema: compiled once
    requests = [replace(r, schema=schema if i % 2 else None) for i, r in enumerate(decode.requests)]
    return Workload("structured", f"{num_requests} short questions, {new_range[0]}-{new_range[1]} new tokens each, "
                    "every other one with a JSON schema (paged_hf_noschema: the same batch without)", seed, requests)


def build_beam(tokenizer, seed: int = 0, num_requests: int = 16, num_beams: int = 4, max_new_tokens: int = 48,
               corpus: list[int] | None = None) -> Workload:
    """Summaries by beam search (HF's `generate(num_beams=4)`): HF keeps num_beams copies of each prompt's KV,
    the engine one copy its beams share. One output length for all: a static batch of beam searches runs to
    its longest request, and a longer search is another search (its best beam cut short is not the best)."""
    mixed = build_mixed(tokenizer, seed, num_requests, prompt_range=(64, 400),
                        new_range=(max_new_tokens, max_new_tokens), corpus=corpus)
    return replace(mixed, name="beam", num_beams=num_beams,
                   description=f"{num_requests} chat requests, prompts ~64-400 tokens, {max_new_tokens} new tokens, "
                   f"beam search of width {num_beams}, EOS ignored")


def build_grounded(tokenizer, seed: int = 0, num_requests: int = 64, prompt_range=(120, 400), new_range=(64, 160),
                   corpus: list[int] | None = None) -> Workload:
    """Chat requests whose answer restates, extracts from or edits their passage: speculative decoding by
    prompt lookup (paged_hf_spec against paged_hf) is for these."""
    rng = random.Random(seed)
    corpus = corpus if corpus is not None else corpus_token_ids(tokenizer)
    requests = []
    for _ in range(num_requests):
        instruction = rng.choice(GROUNDED_INSTRUCTIONS)
        text = passage(tokenizer, corpus, rng.randint(*prompt_range), rng)
        requests.append(BenchRequest(chat_prompt(tokenizer, f"{instruction}\n\n{text}"), rng.randint(*new_range)))
    return Workload("grounded", f"{num_requests} chat requests that restate, copy or edit a ~{prompt_range[0]}-"
                    f"{prompt_range[1]}-token passage, {new_range[0]}-{new_range[1]} new tokens, greedy, EOS ignored",
                    seed, requests)


def build_workload(name: str, tokenizer, seed: int = 0, num_requests: int | None = None,
                   max_new_tokens_scale: float | None = None, num_adapters: int | None = None,
                   random_adapters: bool = False) -> Workload:
    """The named workload, scaled down to its first ``num_requests`` requests if given; `num_adapters`: the lora
    workload's distinct adapters (bench --adapters), which may have more than 64 requests, each on a random
    adapter with `random_adapters`."""
    builders = {"mixed": build_mixed, "prefix": build_prefix, "decode": build_decode, "lora": build_lora,
                "structured": build_structured, "beam": build_beam, "grounded": build_grounded}
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOAD_NAMES)}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"--requests must be >= 1, got {num_requests}")
    if num_adapters is not None:
        if name != "lora":
            raise ValueError(f"--adapters is for --workload lora, not {name!r}")
        workload = build_lora(tokenizer, seed, num_adapters=num_adapters, random_adapters=random_adapters,
                              num_requests=max(64, num_requests or 0))
        return workload.scaled(num_requests, max_new_tokens_scale)
    return builders[name](tokenizer, seed).scaled(num_requests, max_new_tokens_scale)
