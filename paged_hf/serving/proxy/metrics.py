"""The proxy's counters, as Prometheus text: how many requests took each path and what the transfers carried."""

from __future__ import annotations

from collections import Counter

PREFIX = "paged_hf_proxy_"


class ProxyMetrics:
    def __init__(self):
        self.requests: Counter[str] = Counter({"direct": 0, "disaggregated": 0})
        self.transfers = self.transfer_tokens = self.transfer_bytes = 0
        self.prefill_failures = self.fallbacks = 0

    def count_transfer(self, params: dict) -> None:
        """A prefill answered with kv_transfer_params: its `num_tokens` and `num_bytes` summed where they are
        ints (every other key is the servers' business)."""
        self.transfers += 1
        self.transfer_tokens += _count(params.get("num_tokens"))
        self.transfer_bytes += _count(params.get("num_bytes"))

    def render(self) -> str:
        requests = {f'{{path="{path}"}}': n for path, n in sorted(self.requests.items())}
        lines = _counter("requests_total", "Requests routed, by path (direct: decode only; disaggregated: "
                         "prefill then decode).", requests)
        for name, help_text, value in (
                ("transfers_total", "Prefill answers that carried kv_transfer_params.", self.transfers),
                ("transfer_tokens_total", "Prompt tokens the transfers covered (their num_tokens).",
                 self.transfer_tokens),
                ("transfer_bytes_total", "Bytes of KV blocks the transfers carried (their num_bytes).",
                 self.transfer_bytes),
                ("prefill_failures_total", "Prefill calls that failed (no answer, 5xx or no JSON).",
                 self.prefill_failures),
                ("fallbacks_total", "Requests decode computed alone after a prefill failure.", self.fallbacks)):
            lines += _counter(name, help_text, {"": value})
        return "\n".join(lines) + "\n"


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _counter(name: str, help_text: str, samples: dict[str, int]) -> list[str]:
    name = PREFIX + name
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter",
            *(f"{name}{labels} {value}" for labels, value in samples.items())]
