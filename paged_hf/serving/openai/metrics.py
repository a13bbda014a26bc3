"""Prometheus metrics in the text exposition format, written by hand.

Why by hand: the format is a few lines of text and `prometheus_client` would be one more dependency (and a
process-global registry, which tests that build several apps would trip over). Each app owns one
`ServerMetrics`; the engine thread observes latencies, the event loop counts requests and renders, so every
method takes the one lock.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

# Seconds; wide enough for a CPU engine (slow) and a GPU one (fast).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    escaped = (f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in pairs)
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus expects."""

    def __init__(self, name: str, help_text: str, buckets=LATENCY_BUCKETS):
        self.name, self.help_text, self.buckets = name, help_text, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        value = max(0.0, float(value))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_number(float(bound))}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    """Everything /metrics shows: request latencies (observed by the engine thread), request counts per
    model/adapter and per outcome (counted by the app), and the engine's `stats()` snapshot."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram("paged_hf_time_to_first_token_seconds", "Time from arrival to the first output token.")
        self.itl = Histogram("paged_hf_inter_token_latency_seconds", "Time between two output tokens of a sequence.")
        self.e2e = Histogram("paged_hf_e2e_request_latency_seconds", "Time from arrival to the last output token.")
        self.queue_time = Histogram("paged_hf_request_queue_time_seconds",
                                    "Time from arrival until the engine first scheduled the request.")
        self.requests = defaultdict(int)  # (model, adapter) -> accepted requests
        self.finished = defaultdict(int)  # finish_reason -> finished sequences (a request has n)
        self.errors = defaultdict(int)  # HTTP status -> error responses
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def observe(self, **values: float) -> None:
        """Engine thread: `ttft=`, `itl=`, `e2e=`, `queue_time=` in seconds (any subset)."""
        with self._lock:
            for name, value in values.items():
                getattr(self, name).observe(value)

    def count_request(self, model: str, adapter: str | None, num_prompt_tokens: int) -> None:
        with self._lock:
            self.requests[(model, adapter or "")] += 1
            self.prompt_tokens += num_prompt_tokens

    def count_finished(self, finish_reason: str, num_generated_tokens: int, num_sequences: int = 1) -> None:
        with self._lock:
            self.finished[finish_reason] += num_sequences
            self.generation_tokens += num_generated_tokens

    def count_error(self, status_code: int) -> None:
        with self._lock:
            self.errors[status_code] += 1

    def render(self, stats: dict, num_in_flight: int) -> str:
        """The whole exposition; `stats` is the engine's latest `generator.stats()` snapshot."""
        with self._lock:
            lines = _engine_lines(stats, num_in_flight)
            lines += _counter("paged_hf_requests_total", "Requests accepted, per served model and adapter.",
                              {(("model", m), ("adapter", a)): n for (m, a), n in self.requests.items()})
            lines += _counter("paged_hf_sequences_finished_total", "Finished sequences (n per request), per finish reason.",
                              {(("finish_reason", r),): n for r, n in self.finished.items()})
            lines += _counter("paged_hf_request_errors_total", "Error responses, per HTTP status.",
                              {(("status", str(s)),): n for s, n in self.errors.items()})
            lines += _counter("paged_hf_prompt_tokens_total", "Prompt tokens of accepted requests.", {(): self.prompt_tokens})
            lines += _counter("paged_hf_generation_tokens_total", "Generated tokens.", {(): self.generation_tokens})
            for histogram in (self.ttft, self.itl, self.e2e, self.queue_time):
                lines += histogram.render()
        return "\n".join(lines) + "\n"


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {_number(value)}"]


def _counter(name: str, help_text: str, samples: dict) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(labels)} {_number(value)}" for labels, value in sorted(samples.items())]
    return lines


def _engine_lines(stats: dict, num_in_flight: int) -> list[str]:
    num_blocks = stats.get("num_blocks", 0)
    num_free = stats.get("num_free_blocks", 0)
    usage = (num_blocks - num_free) / num_blocks if num_blocks else 0.0
    lines = _gauge("paged_hf_num_requests_running", "Sequences the engine is running.", stats.get("num_running", 0))
    lines += _gauge("paged_hf_num_requests_waiting", "Sequences waiting for a seat.", stats.get("num_waiting", 0))
    lines += _gauge("paged_hf_num_requests_in_flight", "Requests accepted by the server and not finished.", num_in_flight)
    lines += _gauge("paged_hf_kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", usage)
    lines += _gauge("paged_hf_num_blocks", "KV blocks in the pool.", num_blocks)
    lines += _gauge("paged_hf_num_free_blocks", "Free KV blocks (cached but unused count as free).", num_free)
    lines += _counter("paged_hf_num_preemptions_total", "Preemptions (recompute) so far.",
                      {(): stats.get("num_preemptions", 0)})
    lines += _counter("paged_hf_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                      {(): stats.get("prefix_cache_queries", 0)})
    lines += _counter("paged_hf_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                      {(): stats.get("prefix_cache_hits", 0)})
    return lines + _spec_decode_lines(stats)


def _spec_decode_lines(stats: dict) -> list[str]:
    """vLLM's spec_decode counters, when the engine speculates."""
    if "spec_decode_num_drafts" not in stats:
        return []
    lines = _counter("paged_hf_spec_decode_num_drafts_total", "Requests' draft verifications (one per request and step).",
                     {(): stats["spec_decode_num_drafts"]})
    lines += _counter("paged_hf_spec_decode_num_draft_tokens_total", "Draft tokens proposed and verified.",
                      {(): stats["spec_decode_num_draft_tokens"]})
    lines += _counter("paged_hf_spec_decode_num_accepted_tokens_total", "Draft tokens accepted.",
                      {(): stats["spec_decode_num_accepted_tokens"]})
    per_position = stats["spec_decode_num_accepted_tokens_per_pos"]
    lines += _counter("paged_hf_spec_decode_num_accepted_tokens_per_pos_total", "Draft tokens accepted, per position.",
                      {(("position", str(i)),): n for i, n in enumerate(per_position)})
    return lines
