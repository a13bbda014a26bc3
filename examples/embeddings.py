"""Embeddings: offline with `paged_hf.LLM.embed`, or from a running `paged-hf serve` with the `openai` SDK.

    python examples/embeddings.py                       # offline, the default model (last-token pooling)
    python examples/embeddings.py --model FOLDER        # a folder with a sentence-transformers config
    paged-hf serve &  python examples/embeddings.py --base-url http://127.0.0.1:8000/v1

Prints the cosine similarity of each query to each document (the vectors are normalized, so it is their dot
product), and the same with `dimensions=32` (Matryoshka truncation, normalized after it).
"""

from __future__ import annotations

import argparse

QUERIES = ["How do I bake bread?", "What is the capital of France?"]
DOCUMENTS = ["Paris is the capital and largest city of France.", "Knead the dough, let it rise, then bake it."]


def offline(model: str | None):
    """-> embed(texts, dimensions) with the model loaded once."""
    import paged_hf  # noqa: PLC0415

    llm = paged_hf.LLM(model, max_model_len=512)

    def embed(texts: list[str], dimensions: int | None) -> list[list[float]]:
        outputs = llm.embed(texts, paged_hf.PoolingParams(dimensions=dimensions), use_tqdm=False)
        return [output.outputs.embedding for output in outputs]

    return embed


def served(base_url: str, api_key: str):
    """-> embed(texts, dimensions) through the server's /v1/embeddings."""
    from openai import OpenAI  # noqa: PLC0415

    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id

    def embed(texts: list[str], dimensions: int | None) -> list[list[float]]:
        kwargs = {} if dimensions is None else {"dimensions": dimensions}
        return [item.embedding for item in client.embeddings.create(model=model, input=texts, **kwargs).data]

    return embed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="offline: an HF folder (default: the default model)")
    parser.add_argument("--base-url", default=None, help="a running server's /v1 URL (else: offline)")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    args = parser.parse_args()
    embed = served(args.base_url, args.api_key) if args.base_url else offline(args.model)
    for dimensions in (None, 32):
        vectors = embed(QUERIES + DOCUMENTS, dimensions)
        print(f"dimensions={dimensions or len(vectors[0])}")
        for query, q in zip(QUERIES, vectors):
            scores = [sum(a * b for a, b in zip(q, d)) for d in vectors[len(QUERIES):]]
            print(f"  {query!r}: " + ", ".join(f"{s:.3f}" for s in scores))


if __name__ == "__main__":
    main()
