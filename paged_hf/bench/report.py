"""Turning the systems' raw runs into the benchmark's numbers, its table and its JSON (the plot: plot.py).

Why one place: the table, the JSON and the plot must say the same thing, and every number in them has one
definition (useful tokens = what each request asked for, nothing a padded batch produced beyond it).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict

from paged_hf.bench.systems import SystemRun
from paged_hf.bench.workloads import Workload
from paged_hf.utils import percentile

#: Baselines whose greedy outputs the others are compared with, in order of preference (whichever ran).
REFERENCE_SYSTEMS = ("hf_single", "hf_static_8", "hf_static_32")


def useful_tokens(run: SystemRun, workload: Workload) -> int:
    """Tokens each request asked for and got; a static batch's extra tokens past a request's own length and
    anything beyond max_new_tokens do not count."""
    if run.outputs is None:
        return 0
    return sum(min(len(out), r.max_new_tokens) for out, r in zip(run.outputs, workload.requests))


def compare_outputs(run: SystemRun, reference: SystemRun, workload: Workload) -> dict:
    """How many requests produced exactly the reference's tokens (each cut to its own max_new_tokens)."""
    identical, mismatches = 0, []
    for i, (out, ref, request) in enumerate(zip(run.outputs, reference.outputs, workload.requests)):
        a, b = out[:request.max_new_tokens], ref[:request.max_new_tokens]
        if a == b:
            identical += 1
        else:
            first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({"request": i, "first_difference": first})
    return {"identical": identical, "compared": len(workload.requests), "mismatches": mismatches}


def system_metrics(run: SystemRun, workload: Workload) -> dict:
    if run.skipped or run.error:
        return {"skipped": run.skipped, "error": run.error, "peak_rss_bytes": run.peak_rss_bytes, "extra": run.extra}
    tokens = useful_tokens(run, workload)
    return {
        "useful_tokens": tokens,
        "tokens_per_s": tokens / run.wall_s if run.wall_s else 0.0,
        "wall_s": run.wall_s,
        "ttft_p50_s": percentile(run.ttft_s, 50), "ttft_p90_s": percentile(run.ttft_s, 90),
        "tpot_p50_s": percentile(run.tpot_s, 50), "tpot_p90_s": percentile(run.tpot_s, 90),
        "peak_rss_bytes": run.peak_rss_bytes,
        "num_threads": run.num_threads,
        "extra": run.extra,
    }


def pick_reference(runs: dict[str, SystemRun]) -> str | None:
    for name in REFERENCE_SYSTEMS:
        run = runs.get(name)
        if run is not None and run.outputs is not None:
            return name
    return None


def build_report(workload: Workload, runs: dict[str, SystemRun], machine_limit: dict | None, settings: dict) -> dict:
    """The whole benchmark as one JSON-able dict: per-system metrics, ratios, parity, prefix cache, machine."""
    systems = {name: system_metrics(run, workload) for name, run in runs.items()}
    reference = pick_reference(runs)
    exact = ("paged_hf_spec", "paged_hf_kvdisk", "paged_hf_kvhost")  # speculation, a KV tier: not a token changes
    if reference is None and any(s in runs for s in exact) and runs.get("paged_hf") and runs["paged_hf"].outputs:
        reference = "paged_hf"
    for name, run in runs.items():
        if reference is not None and run.outputs is not None:
            systems[name]["outputs_vs_reference"] = compare_outputs(run, runs[reference], workload)
    paged = systems.get("paged_hf", {}).get("tokens_per_s")
    for metrics in systems.values():
        tok_s = metrics.get("tokens_per_s")
        metrics["paged_hf_speedup"] = paged / tok_s if paged and tok_s else None
    report = {"workload": workload.summary(), "settings": settings, "reference_system": reference,
              "systems": systems}
    prefix = prefix_cache_summary(systems)
    if prefix:
        report["prefix_cache"] = prefix
    if machine_limit is not None:
        report["machine"] = machine_limit
        wall = systems.get("paged_hf", {}).get("wall_s")
        if wall:
            report["paged_hf_fraction_of_limit"] = machine_limit["min_time_s"] / wall
            report["paged_hf_fraction_of_limit_prefix_once"] = machine_limit["min_time_prefix_once_s"] / wall
    return report


def prefix_cache_summary(systems: dict) -> dict | None:
    """paged_hf's prefix cache hit rate (in tokens) and TTFT with and without caching, when both ran."""
    paged = systems.get("paged_hf", {})
    extra = paged.get("extra") or {}
    if not extra.get("prefix_cache_queries"):
        return None
    summary = {"hit_rate": extra["prefix_cache_hits"] / extra["prefix_cache_queries"],
               "hits_tokens": extra["prefix_cache_hits"], "queries_tokens": extra["prefix_cache_queries"],
               "ttft_p50_s_with_caching": paged.get("ttft_p50_s"), "ttft_p90_s_with_caching": paged.get("ttft_p90_s")}
    without = systems.get("paged_hf_noprefix", {})
    if "ttft_p50_s" in without:
        summary["ttft_p50_s_without_caching"] = without["ttft_p50_s"]
        summary["ttft_p90_s_without_caching"] = without["ttft_p90_s"]
    return summary


# --- presentation ---------------------------------------------------------------------------------------------

def _fmt(value, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


COLUMNS = ("system", "tok/s", "wall s", "TTFT p50", "TPOT p50", "peak RSS GB", "paged_hf x", "identical")


def table_rows(report: dict) -> list[list[str]]:
    rows = []
    for name, m in report["systems"].items():
        if "tokens_per_s" not in m:
            rows.append([name, m.get("skipped") or f"error: {m.get('error')}", "", "", "", "", "", ""])
            continue
        parity = m.get("outputs_vs_reference")
        rows.append([
            name, _fmt(m["tokens_per_s"], ".1f"), _fmt(m["wall_s"], ".1f"),
            _fmt(m["ttft_p50_s"], ".2f", suffix=" s"), _fmt(m["tpot_p50_s"], ".0f", 1000, " ms"),
            _fmt(m["peak_rss_bytes"], ".2f", 1 / 1e9), _fmt(m["paged_hf_speedup"], ".2f", suffix="x"),
            f"{parity['identical']}/{parity['compared']}" if parity else "-",
        ])
    return rows


def format_table(report: dict) -> str:
    """The human-readable summary printed to stdout."""
    rows = [list(COLUMNS)] + table_rows(report)
    widths = [max(len(row[i]) for row in rows if len(row[i]) < 40) for i in range(len(COLUMNS))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    w = report["workload"]
    head = (f"workload {w['name']}: {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens, "
            f"{w['new_tokens']} new tokens (seed {w['seed']}); outputs compared with "
            f"{report['reference_system'] or 'no HF baseline'}")
    return "\n".join([head, *lines, *_footer_lines(report)])


def _footer_lines(report: dict) -> list[str]:
    settings = report.get("settings") or {}
    lines = [f"measured on {settings['host']}, {settings.get('dtype')}: {settings.get('command')}"] if settings.get(
        "host") else []
    if settings.get("model_shape"):  # a --model-shape run: name the shape, its random weights and smaller vocab
        lines.append(f"model: {settings['model']}")
    loads = {n: (m.get("extra") or {}).get("other_cpu_load") for n, m in report["systems"].items()
             if "tokens_per_s" in m}
    loads = {n: v for n, v in loads.items() if v is not None}
    if loads and max(loads.values()) > 0.1:
        lines.append("note: other processes kept the CPUs busy while systems ran ("
                     + ", ".join(f"{n} {v:.0%}" for n, v in loads.items()) + "): these numbers are noisy")
    rounds = rounds_line(report)
    if rounds:
        lines.append(rounds)
    kv = kv_cache_line(report)
    if kv:
        lines.append(kv)
    spec = spec_decode_line(report)
    if spec:
        lines.append(spec)
    prefix = report.get("prefix_cache")
    if prefix:
        line = (f"prefix cache: {prefix['hit_rate']:.0%} of prompt tokens hit; TTFT p50 "
                f"{_fmt(prefix['ttft_p50_s_with_caching'], '.2f')} s with caching")
        if "ttft_p50_s_without_caching" in prefix:
            line += f", {_fmt(prefix['ttft_p50_s_without_caching'], '.2f')} s without"
        lines.append(line)
    limit = report.get("machine")
    if limit:
        rates = limit["rates"]
        lines.append(
            f"machine: matmul {rates['matmul_flops_mlp'] / 1e9:.0f} GFLOP/s ({rates['matmul_rows']} rows), lm_head "
            f"{rates['matmul_flops_lm_head'] / 1e9:.0f}, one row {rates['matmul_flops_one_row'] / 1e9:.1f}; copy "
            f"{rates['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (read + write), read "
            f"{rates['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; {rates['num_threads']} threads")
        line = (f"limit: {limit['total_flops'] / 1e12:.2f} TFLOP -> at least {limit['min_time_s']:.1f} s "
                f"({limit['max_useful_tokens_per_s']:.0f} useful tok/s)")
        if "paged_hf_fraction_of_limit" in report:
            line += f"; paged_hf reaches {report['paged_hf_fraction_of_limit']:.0%} of it"
        lines.append(line)
        moved = weights_moved_line(report)
        if moved:
            lines.append(moved)
    return lines


def weights_moved_line(report: dict) -> str | None:
    """One request: each step reads every weight once, so a system's tok/s times its weights' bytes is the memory
    bandwidth its decode moves (prefill counted in the wall: a lower bound); set against the measured read."""
    read = report["machine"]["rates"].get("read_bandwidth_bytes_per_s")
    if report["workload"]["num_requests"] != 1 or not read:
        return None
    moved = {n: (m["extra"]["step_weight_bytes"], m["tokens_per_s"]) for n, m in report["systems"].items()
             if m.get("tokens_per_s") and "step_weight_bytes" in (m.get("extra") or {})}
    if not moved:
        return None
    return "weights read a token: " + "; ".join(
        f"{n} {size / 1e9:.2f} GB x {tok_s:.1f} tok/s = {size * tok_s / 1e9:.1f} GB/s ({size * tok_s / read:.0%} of "
        f"read)" for n, (size, tok_s) in moved.items())


def rounds_line(report: dict) -> str | None:
    """With --rounds N: every round's wall time of each system (the table shows each one's median run)."""
    walls = {n: (m.get("extra") or {}).get("rounds_wall_s") for n, m in report["systems"].items()}
    walls = {n: w for n, w in walls.items() if w}
    if not walls:
        return None
    return ("rounds (systems taking turns; the table shows each one's median): wall s "
            + "; ".join(f"{n} " + ", ".join(f"{w:.1f}" for w in ws) for n, ws in walls.items()))


def kv_cache_line(report: dict) -> str | None:
    """With a quantized-cache system (paged_hf_kv_*): each paged_hf system's KV dtype, blocks and the most
    requests it ran at once (the same --kv-cache-memory holds more blocks of a smaller dtype)."""
    systems = {n: m.get("extra") or {} for n, m in report["systems"].items() if n.startswith("paged_hf")}
    if not any(n.startswith("paged_hf_kv_") for n in systems):
        return None
    return "KV cache: " + "; ".join(
        f"{n} {e.get('kv_cache_dtype', 'auto')} {e.get('num_blocks', '-')} blocks, at most "
        f"{e.get('max_num_running', '-')} running, {e.get('num_preemptions', '-')} preemptions"
        for n, e in systems.items() if "num_blocks" in e)


def spec_decode_line(report: dict) -> str | None:
    """paged_hf_spec's acceptance and its speed against paged_hf, when it ran."""
    spec = report["systems"].get("paged_hf_spec", {})
    counters = (spec.get("extra") or {}).get("spec_decode")
    if not counters:
        return None
    line = (f"speculation: {counters['spec_decode_num_accepted_tokens']}/{counters['spec_decode_num_draft_tokens']}"
            f" draft tokens accepted ({counters['spec_decode_acceptance_rate']:.0%}), per position "
            f"{counters['spec_decode_num_accepted_tokens_per_pos']} of {counters['spec_decode_num_drafts']} drafts")
    if spec.get("paged_hf_speedup"):
        line += f"; paged_hf_spec / paged_hf = {1 / spec['paged_hf_speedup']:.2f}x tok/s"
    return line


def output_name(report: dict) -> str:
    """`bench_<workload>`, with `_<shape>` for a --model-shape run and `_<dtype>` for other dtypes than float32: the
    files of every shape and dtype can sit side by side."""
    dtype = report["settings"].get("dtype") or "float32"
    shape = (report["settings"].get("model_shape") or {}).get("name")
    return (f"bench_{report['workload']['name']}" + (f"_{shape}" if shape else "")
            + ("" if dtype == "float32" else f"_{dtype}"))


def write_json(report: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{output_name(report)}.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2, default=_json_default)
    return path


def _json_default(value):
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, float) and math.isinf(value):
        return None
    return str(value)
