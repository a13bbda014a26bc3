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
from dataclasses import dataclass

# Seconds; wide enough for a CPU engine (slow) and a GPU one (fast).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Tenants with their own series; later ones share OTHER_TENANT (a client's `user` field must not grow /metrics
# without bound).
MAX_TENANTS = 256
OTHER_TENANT = "_other"


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

    def add(self, other: Histogram) -> Histogram:
        """This histogram with `other`'s observations added (same buckets)."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.sum += other.sum
        self.count += other.count
        return self

    def render(self, labels: tuple[tuple[str, str], ...] = (), header: bool = True) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"] if header else []
        cumulative = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{_labels((*labels, ("le", _number(float(bound)))))} {cumulative}')
        lines += [f"{self.name}_sum{_labels(labels)} {_number(self.sum)}",
                  f"{self.name}_count{_labels(labels)} {self.count}"]
        return lines


@dataclass(frozen=True)
class MetricsView:
    """What one reader of /metrics sees (tenancy.py): every tenant (`owner` None), or only the per-tenant series
    of one API key's requests, and no label naming an adapter that another key loaded (`hidden_adapters`)."""

    owner: str | None = None
    hidden_adapters: frozenset = frozenset()


class TenantMetrics:
    """One tenant's series (the `user` field, else the API key's name, else the adapter; "" for none)."""

    def __init__(self):
        self.requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.queue_time = Histogram("paged_hf_tenant_queue_time_seconds",
                                    "Per tenant: time from arrival until the engine first scheduled the request.")
        self.ttft = Histogram("paged_hf_tenant_time_to_first_token_seconds",
                              "Per tenant: time from arrival to the first output token.")

    def add(self, other: TenantMetrics) -> TenantMetrics:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.generation_tokens += other.generation_tokens
        self.queue_time.add(other.queue_time)
        self.ttft.add(other.ttft)
        return self


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
        self.tenants: dict[tuple[str | None, str], TenantMetrics] = {}  # (API key owner, tenant) -> series

    def _tenant(self, tenant: str, owner: str | None) -> TenantMetrics:
        """Under the lock. `owner`: the API key whose requests these are (tenancy.py; None without tenants)."""
        if (owner, tenant) not in self.tenants and len(self.tenants) >= MAX_TENANTS:
            tenant = OTHER_TENANT
        return self.tenants.setdefault((owner, tenant), TenantMetrics())

    def observe_tenant(self, tenant: str, queue_time: float | None = None, ttft: float | None = None,
                       generation_tokens: int = 0, owner: str | None = None) -> None:
        """Engine thread: a tenant's queue time, time to first token (seconds) and newly served tokens."""
        with self._lock:
            metrics = self._tenant(tenant, owner)
            if queue_time is not None:
                metrics.queue_time.observe(queue_time)
            if ttft is not None:
                metrics.ttft.observe(ttft)
            metrics.generation_tokens += generation_tokens

    def count_tenant_request(self, tenant: str, num_prompt_tokens: int, owner: str | None = None) -> None:
        with self._lock:
            metrics = self._tenant(tenant, owner)
            metrics.requests += 1
            metrics.prompt_tokens += num_prompt_tokens

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

    def render(self, stats: dict, num_in_flight: int, view: MetricsView = MetricsView()) -> str:
        """The whole exposition as `view` may see it; `stats` is the engine's latest `generator.stats()`."""
        with self._lock:
            lines = _engine_lines(stats, num_in_flight, view.hidden_adapters)
            lines += _counter("paged_hf_requests_total", "Requests accepted, per served model and adapter.",
                              {(("model", m), ("adapter", a)): n for (m, a), n in self.requests.items()
                               if a not in view.hidden_adapters})
            lines += _counter("paged_hf_sequences_finished_total", "Finished sequences (n per request), per finish reason.",
                              {(("finish_reason", r),): n for r, n in self.finished.items()})
            lines += _counter("paged_hf_request_errors_total", "Error responses, per HTTP status.",
                              {(("status", str(s)),): n for s, n in self.errors.items()})
            lines += _counter("paged_hf_prompt_tokens_total", "Prompt tokens of accepted requests.", {(): self.prompt_tokens})
            lines += _counter("paged_hf_generation_tokens_total", "Generated tokens.", {(): self.generation_tokens})
            for histogram in (self.ttft, self.itl, self.e2e, self.queue_time):
                lines += histogram.render()
            lines += self._tenant_lines(view.owner)
        return "\n".join(lines) + "\n"

    def _tenant_lines(self, owner: str | None) -> list[str]:
        """Under the lock. `owner`: only that API key's series; None: every key's, one series per tenant."""
        merged: dict[str, TenantMetrics] = {}
        for (series_owner, tenant), metrics in self.tenants.items():
            if owner is None or series_owner == owner:
                merged.setdefault(tenant, TenantMetrics()).add(metrics)
        if not merged:
            return []
        tenants = sorted(merged.items())
        lines = []
        for name, help_text, attr in (("paged_hf_tenant_requests_total", "Requests accepted, per tenant.", "requests"),
                                      ("paged_hf_tenant_prompt_tokens_total", "Prompt tokens, per tenant.",
                                       "prompt_tokens"),
                                      ("paged_hf_tenant_generation_tokens_total", "Generated tokens, per tenant.",
                                       "generation_tokens")):
            lines += _counter(name, help_text, {(("tenant", t),): getattr(m, attr) for t, m in tenants})
        for attr in ("queue_time", "ttft"):
            first = getattr(tenants[0][1], attr)
            lines += [f"# HELP {first.name} {first.help_text}", f"# TYPE {first.name} histogram"]
            for tenant, metrics in tenants:
                lines += getattr(metrics, attr).render((("tenant", tenant),), header=False)
        return lines


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {_number(value)}"]


def _counter(name: str, help_text: str, samples: dict) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(labels)} {_number(value)}" for labels, value in sorted(samples.items())]
    return lines


def _engine_lines(stats: dict, num_in_flight: int, hidden_adapters: frozenset = frozenset()) -> list[str]:
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
    return lines + _spec_decode_lines(stats) + _lora_lines(stats, hidden_adapters) + _kv_tier_lines(stats)


def _lora_lines(stats: dict, hidden_adapters: frozenset = frozenset()) -> list[str]:
    """The adapter store's three levels (engine.adapter_store), when adapters are served; vLLM's info gauge."""
    if "lora_in_memory" not in stats:
        return []
    lines = _gauge("paged_hf_lora_registered", "LoRA adapters registered (loaded or found under the LoRA root).",
                   stats["lora_registered"])
    lines += _gauge("paged_hf_lora_in_memory", "LoRA adapters in host memory.", stats["lora_in_memory"])
    lines += _gauge("paged_hf_lora_in_slots", "LoRA adapters in device slots.", stats["lora_in_slots"])
    lines += _counter("paged_hf_lora_loads_total", "Adapter folders read from disk.", {(): stats["lora_loads"]})
    for name in ("lora_load_seconds_p50", "lora_load_seconds_p99", "lora_wait_seconds_p99"):
        lines += _gauge(f"paged_hf_{name}", "Adapter reads (load) and requests' queue time waiting for one (wait), "
                        "over the last 4096.", stats[name])
    running, waiting = ([name for name in stats[key] if name not in hidden_adapters]
                        for key in ("lora_running_adapters", "lora_waiting_adapters"))
    info = (("max_lora", str(stats["max_loras"])), ("running_lora_adapters", ",".join(running)),
            ("waiting_lora_adapters", ",".join(waiting)))
    lines += ["# HELP paged_hf_lora_requests_info Running and waiting requests' adapters (vLLM's gauge).",
              "# TYPE paged_hf_lora_requests_info gauge", f"paged_hf_lora_requests_info{_labels(info)} 1"]
    return lines


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


def _kv_tier_lines(stats: dict) -> list[str]:
    """The KV tier under the prefix cache (host memory, --kv-cache-dir), when the engine has one."""
    if "kv_tier_queries" not in stats:
        return []
    lines = _counter("paged_hf_external_prefix_cache_queries_total", "Prompt tokens looked up in the KV tier.",
                     {(): stats["kv_tier_queries"]})
    lines += _counter("paged_hf_external_prefix_cache_hits_total", "Prompt tokens found in the KV tier.",
                      {(): stats["kv_tier_hits"]})
    lines += _counter("paged_hf_kv_tier_bytes_written_total", "Bytes of KV blocks saved to the tier.",
                      {(): stats["kv_tier_bytes_written"]})
    lines += _counter("paged_hf_kv_tier_bytes_read_total", "Bytes of KV blocks read from disk.",
                      {(): stats["kv_tier_bytes_read"]})
    lines += _counter("paged_hf_kv_tier_read_seconds_total", "Seconds spent reading KV blocks from disk.",
                      {(): stats["kv_tier_read_seconds"]})
    lines += _counter("paged_hf_kv_tier_bad_files_total", "Block files skipped as corrupt or foreign.",
                      {(): stats["kv_tier_bad_files"]})
    lines += _gauge("paged_hf_kv_tier_host_bytes", "Bytes of KV blocks held in host memory.",
                    stats["kv_tier_host_bytes"])
    lines += _gauge("paged_hf_kv_tier_disk_bytes", "Bytes of KV block files in --kv-cache-dir.",
                    stats["kv_tier_disk_bytes"])
    return lines
