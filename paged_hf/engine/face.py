"""`EngineFace`: everything a server (paged_hf/serving/) and the ranks that mirror an engine use of it, and no more.

The server runs the engine on one thread of its own and reads nothing else of it: submit and abort requests, do a
request's slow work off that thread first (`prepare`), step, tell whether a request has started, the engine's
limits and statistics, its LoRA adapters, the KV tier it shares with other instances. `ContinuousBatchGenerator`
implements it, and so does the server's lockstep wrapper for tensor and pipeline parallelism (which mirrors the
calls that change the engine on every rank). tests/serving/test_engine_face.py checks that serving/ reads an
engine through these names only, as tests/test_layers.py checks the imports.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

#: the calls that change an engine: the ones a lockstep engine applies on every rank, in order
MUTATING = ("add_request", "abort", "load_adapter", "unload_adapter")


@dataclass(frozen=True)
class EngineLimits:
    """What a request may ask of this engine, fixed when it was made."""
    max_model_len: int  # a request's prompt and new tokens at most (also what the whole KV cache holds)
    vocab_size: int
    max_num_seqs: int  # requests running at once
    max_grammar_depth: int  # a JSON schema's nesting at most (structured outputs)
    lora_root: str | None  # a folder whose adapter folders are served by name, read on first use
    images: bool = False  # prompts may hold images (a vision-language model wrapped with its processor)


@dataclass(frozen=True)
class Preparation:
    """A request's slow engine-side work, started off the engine thread (`EngineFace.prepare`): its grammar compiling
    in the compiler's pool. `timed_out()` is the error for a compile still running after `timeout_s` seconds."""
    future: Future
    timeout_s: float
    timed_out: Callable[[], Exception]


class EngineFace(abc.ABC):
    """An engine as its server sees it. Not thread-safe, but `prepare` (any thread) and `limits` (fixed)."""

    @property
    @abc.abstractmethod
    def limits(self) -> EngineLimits: ...

    @abc.abstractmethod
    def add_request(self, prompt, sampling_params=None, adapter: str | None = None, request_id: str | None = None,
                    *, cache_salt: str | None = None, priority: int = 0, tenant: str | None = None) -> str:
        """Queue a request (token ids; SamplingParams, or PoolingParams for an embedding); ValueError for bad input,
        nothing queued."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; a no-op for one that finished."""

    @abc.abstractmethod
    def step(self) -> list:
        """One scheduler iteration -> the RequestOutputs of the requests that changed."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abc.abstractmethod
    def has_started(self, request_id: str) -> bool:
        """The engine has computed some of the request's tokens (its queue time is over); True once it is gone."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """The engine's counters (blocks, running, waiting, preemptions, prefix cache, adapters, KV tier)."""

    @abc.abstractmethod
    def prepare(self, sampling_params) -> Preparation | None:
        """Thread-safe: check the params and start their slow work (tokenized bad words, a compiling grammar);
        None when nothing is left to wait for. ValueError for what `add_request` would refuse."""

    @abc.abstractmethod
    def process_prompt(self, prompt, add_special_tokens: bool | None = None):
        """Thread-safe: a prompt dict (vLLM's, with `multi_modal_data` images) -> what `add_request` takes as its
        prompt, the processor's work (pixels, placeholders, content hashes) done on the calling thread. ValueError
        for what `add_request` would refuse."""

    @abc.abstractmethod
    def adapter_names(self) -> list[str]:
        """Adapters loaded or registered by name."""

    @abc.abstractmethod
    def resident_adapter_names(self) -> list[str]:
        """Adapters whose weights are in device slots now (a router prefers a replica that has them)."""

    @abc.abstractmethod
    def load_adapter(self, name: str, path) -> None: ...

    @abc.abstractmethod
    def unload_adapter(self, name: str) -> None: ...

    @abc.abstractmethod
    def kv_transfer(self):
        """(the KVTransferConfig, the KV tier holding the block files) of a disaggregated instance, else None."""


#: the names a server may read of an engine
FACE = frozenset(name for name in vars(EngineFace) if not name.startswith("_"))
