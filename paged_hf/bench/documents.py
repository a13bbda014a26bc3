"""`paged-hf bench --workload documents`: many long documents, each asked a few short questions in turn, with a
pool that holds only a few of them: what the KV tier (host memory, a directory) is for.

32 distinct ~2,000-token documents (windows of the corpus), 4 turns: turn k asks question k of every document,
round-robin, and each prompt is the document followed by its question, so a turn re-uses the document's prefix
from the turn before. Turn k + 1 starts when turn k has finished (`BenchRequest.wave`: one generate() call per
wave); the requests of one turn arrive together. The engine's pool holds ~4 documents' blocks, so without a
tier each turn recomputes every document; with one (paged_hf_kvhost: host memory big enough for all of them,
paged_hf_kvdisk: a directory) turns 2-4 read the documents' blocks back. Short greedy answers, EOS ignored.

`--requests N` takes the first N documents (all their turns), e.g. `--requests 8` for a quick check.
"""

from __future__ import annotations

import random

from paged_hf.bench.workloads import (
    CORPUS_MODULES,
    QUESTION_TEMPLATES,
    BenchRequest,
    Workload,
    chat_prompt,
    corpus_token_ids,
    module_docs,
    passage,
)
from paged_hf.config.groups import CacheConfig
from paged_hf.utils import cdiv

#: the documents workload's systems: the same engine without a tier, with host memory, with a directory
DOCUMENT_SYSTEMS = ("paged_hf", "paged_hf_kvhost", "paged_hf_kvdisk")
#: paged_hf with a host-memory tier (`kv_offloading_size` GiB unless the engine config sets one): enough for
#: the 32 documents of SmolLM2-135M in float32 (~46 KB of K/V a token, ~3.1 GB), held only as used
KV_HOST_SYSTEM = "paged_hf_kvhost"
KV_HOST_GIB = 4.0


def build_documents(tokenizer, seed: int = 0, num_documents: int = 32, num_turns: int = 4,
                    document_tokens: int = 2000, new_range=(16, 32), pool_documents: int = 4,
                    block_size: int = CacheConfig.block_size, corpus: list[int] | None = None) -> Workload:
    """`num_documents` windows of the corpus, each asked `num_turns` questions (turn-major order, one wave a
    turn); the workload's pool (`num_blocks`) holds `pool_documents` of its longest requests."""
    if num_documents < 1 or num_turns < 1:
        raise ValueError(f"documents workload: need >= 1 document and turn, got {num_documents}, {num_turns}")
    rng = random.Random(seed)
    corpus = corpus if corpus is not None else corpus_token_ids(tokenizer)
    documents = [passage(tokenizer, corpus, document_tokens, rng) for _ in range(num_documents)]
    names = [n for m in CORPUS_MODULES for n in module_docs(m)[1]]
    subjects = [rng.choice(names) for _ in documents]
    requests = []
    for turn in range(num_turns):
        for document, subject in zip(documents, subjects):
            question = QUESTION_TEMPLATES[turn % len(QUESTION_TEMPLATES)].format(name=subject)
            prompt = chat_prompt(tokenizer, f"{document}\n\nQuestion: {question}")  # the document first: shared
            requests.append(BenchRequest(prompt, rng.randint(*new_range), wave=turn))
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
    return Workload("documents", f"{num_documents} documents of ~{document_tokens} tokens, each asked {num_turns} "
                    f"questions in turn (one wave a turn), {new_range[0]}-{new_range[1]} new tokens, greedy, EOS "
                    f"ignored; a pool of {pool_documents} documents", seed, requests,
                    num_blocks=pool_documents * cdiv(longest, block_size))


def build_documents_workload(tokenizer, seed: int = 0, num_documents: int | None = None,
                             max_new_tokens_scale: float | None = None) -> Workload:
    """`bench --workload documents [--requests N]`: N documents (default 32), every turn of each."""
    return build_documents(tokenizer, seed, num_documents or 32).scaled(None, max_new_tokens_scale)


def generate_in_waves(generator, workload: Workload, params: list, adapters: list | None = None) -> list:
    """The workload's requests through `generator.generate`, one call per wave in wave order (a wave starts
    when the one before it has finished) -> the outputs in workload order. One call when there is one wave."""
    waves = sorted({r.wave for r in workload.requests})
    outputs = [None] * len(workload.requests)
    for wave in waves:
        index = [i for i, r in enumerate(workload.requests) if r.wave == wave]
        chosen = generator.generate([workload.requests[i].prompt_token_ids for i in index], [params[i] for i in index],
                                    adapters=[adapters[i] for i in index] if adapters else None, use_tqdm=False)
        for i, out in zip(index, chosen):
            outputs[i] = out
    return outputs
