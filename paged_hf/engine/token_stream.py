"""`TokenStream`: what `ContinuousBatchGenerator.stream()` returns, one request's new token ids as they come.

The stream owns its request: it is aborted (blocks freed at once, no output left for `step()`) when the stream
is closed, leaves its `with` block or is dropped; a `break` out of `for tokens in gen.stream(...)` drops it.
"""

from __future__ import annotations

from collections.abc import Callable

from paged_hf.engine.request_group import RequestGroup


class TokenStream:
    def __init__(self, group: RequestGroup, step: Callable[[], object], release: Callable[[RequestGroup], None]):
        """`step` runs one engine step, `release` ends the request: the generator's `step_for_call` and `release`
        (callables, so that the stream needs nothing else of the engine)."""
        self._step_engine = step
        self._release_group = release
        self._group: RequestGroup | None = group
        self._num_seen = 0

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> list[int]:
        """The token ids generated since the last call; steps the engine (all requests) until there are some."""
        group = self._group
        if group is None:
            raise StopIteration
        tokens = group.children[0].output_token_ids
        try:
            while len(tokens) <= self._num_seen and not group.finished:
                self._step_engine()
        except BaseException:
            self.close()
            raise
        if len(tokens) > self._num_seen:
            new, self._num_seen = list(tokens[self._num_seen :]), len(tokens)
            return new
        self.close()
        raise StopIteration

    def close(self) -> None:
        """End the request now if it is still running (idempotent)."""
        group, self._group = self._group, None
        if group is not None:
            self._release_group(group)

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
