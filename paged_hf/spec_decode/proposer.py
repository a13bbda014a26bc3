"""The interface every proposer offers the `Speculator`: drafts for a batch of decoding requests, and the
hooks a proposer with per-request state needs (after verification, and when a request's blocks go back)."""

from __future__ import annotations


class Proposer:
    #: whether requests with a LoRA adapter may get drafts (a draft model has no adapters)
    serves_adapters = True

    def propose_batch(self, requests: list, num_drafts: list[int]) -> list[list[int]]:
        """Per request, up to `num_drafts[i]` draft tokens to follow its tokens (fewer, or none, are fine)."""
        raise NotImplementedError

    def commit(self, request) -> None:
        """The request took its verified tokens (its rejected drafts are gone): bring per-request state along."""

    def free(self, request) -> None:
        """The request's blocks went back (finished, aborted, preempted): drop its state."""
