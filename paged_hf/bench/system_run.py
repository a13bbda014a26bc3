"""What a bench system reports (`SystemRun`), and the small measures every system's run shares."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SystemRun:
    """What one worker reports. Times in seconds; per-request lists in workload order (None: not measurable)."""

    system: str
    wall_s: float | None = None
    outputs: list[list[int]] | None = None
    ttft_s: list[float] | None = None
    tpot_s: list[float] | None = None
    peak_rss_bytes: int | None = None
    num_threads: int | None = None
    extra: dict = field(default_factory=dict)
    skipped: str | None = None
    error: str | None = None


def time_per_output_token(first: float | None, last: float | None, num_tokens: int) -> float | None:
    """(last - first) / (tokens - 1); None for a request of one token (it has no time between tokens)."""
    return (last - first) / (num_tokens - 1) if num_tokens > 1 else None


def warmup_ids(tokenizer) -> list[int]:
    """A tiny prompt without the chat template, so warming up leaves nothing in a prefix cache that the workload
    could hit."""
    return tokenizer("Warm up.", add_special_tokens=False)["input_ids"] or [0]
