"""The paged_hf / llama.cpp comparison's figures and tables (:mod:`.peer` measures, this module does arithmetic).

Per precision and stream count N, for each engine: total tok/s (new tokens of the whole run per second), per
stream tok/s (total / N), the ratio paged_hf / llama.cpp, and the fraction of the memory-read limit reached:
a decode step reads every weight once for all N streams, so an engine at total tok/s T makes T / N steps per
second and reads ``step weight bytes x T / N`` bytes per second, against the machine's measured streaming read
rate (:func:`.machine.read_bandwidth`). At N = 1 that is the weight bytes per token x tok/s / read B/s, the
fraction of the bandwidth a batch-1 decode can use (the KV cache's reads, small here, are not counted).
Over several turns (`--rounds`) every figure is the median of the turns' and the ratio the median of the turns'
own ratios, printed with their lowest and highest.
"""

from __future__ import annotations

import statistics

#: precision -> (paged_hf's dtype, its quantization, the GGUF type llama.cpp runs against it)
PRECISIONS = {
    "float32": ("float32", None, "f32"),
    "bfloat16": ("bfloat16", None, "bf16"),
    "int8": ("bfloat16", "int8", "q8_0"),
    "w4a16": ("bfloat16", "w4a16", "q4_0"),
    "w4a8": ("bfloat16", "w4a8", "q4_0"),
}
LABELS = {"float32": "float32 vs F32", "bfloat16": "bfloat16 vs BF16", "int8": "int8 (W8A8) vs Q8_0",
          "w4a16": "w4a16 vs Q4_0", "w4a8": "w4a8 vs Q4_0"}


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """paged_hf / llama.cpp, None where either is missing."""
    return ours / theirs if ours and theirs else None


def read_fraction(step_bytes: int | None, total_tokens_per_s: float | None, streams: int,
                  read_bytes_per_s: float | None) -> float | None:
    """The fraction of the memory-read limit: step bytes x steps per second (total tok/s / streams) / read B/s."""
    if not (step_bytes and total_tokens_per_s and read_bytes_per_s):
        return None
    return step_bytes * (total_tokens_per_s / streams) / read_bytes_per_s


def engine_figures(total: float | None, streams: int, step_bytes: int | None, read_bps: float | None) -> dict:
    return {"total_tokens_per_s": total, "per_stream_tokens_per_s": total / streams if total else None,
            "read_fraction": read_fraction(step_bytes, total, streams, read_bps)}


def precision_rows(name: str, paged: dict, llama: dict, streams: list[int], read_bps: float | None) -> dict:
    """One precision's batch-1 row (paged_hf's 1 stream against llama-bench) and its curve (paged_hf's N streams
    against llama-batched-bench's N)."""
    paged_streams, batched = paged.get("streams", {}), llama.get("batched", {})
    ours_bytes, their_bytes = paged.get("step_weight_bytes"), llama.get("step_weight_bytes")
    ours_one = paged_streams.get("1", {}).get("tokens_per_s")
    theirs_one = llama.get("bench", {}).get("tokens_per_s")
    curve = []
    for count in streams:
        ours = paged_streams.get(str(count), {}).get("tokens_per_s")
        theirs = (batched.get(str(count)) or batched.get(count) or {}).get("tokens_per_s")
        curve.append({"streams": count, "paged_hf": engine_figures(ours, count, ours_bytes, read_bps),
                      "llamacpp": engine_figures(theirs, count, their_bytes, read_bps),
                      "ratio": ratio(ours, theirs)})
    return {"precision": name, "label": LABELS.get(name, name),
            "batch1": {"paged_hf": engine_figures(ours_one, 1, ours_bytes, read_bps),
                       "llamacpp": engine_figures(theirs_one, 1, their_bytes, read_bps),
                       "ratio": ratio(ours_one, theirs_one)},
            "curve": curve, "paged_hf_step_weight_bytes": ours_bytes, "llamacpp_step_weight_bytes": their_bytes,
            "paged_hf_error": paged.get("error"), "llamacpp_error": llama.get("error") or llama.get("skipped"),
            "paged_hf_memory": paged.get("memory")}


def combine_turns(rows: list[dict], streams: list[int], read_bps: float | None) -> dict:
    """One precision's rows of several turns (`--rounds`) as one: each engine's tok/s the median of its turns',
    each ratio the median of the turns' own ratios (a turn's two engines ran minutes apart: a drift of the host's
    read rate moves both alike), those ratios kept beside it ("turn_ratios"). One turn: its row, as it is."""
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    ours_bytes, their_bytes = first["paged_hf_step_weight_bytes"], first["llamacpp_step_weight_bytes"]

    def point(points: list[dict], count: int) -> dict:
        ours = _median([p["paged_hf"]["total_tokens_per_s"] for p in points])
        theirs = _median([p["llamacpp"]["total_tokens_per_s"] for p in points])
        ratios = [p["ratio"] for p in points if p["ratio"] is not None]
        return {"paged_hf": engine_figures(ours, count, ours_bytes, read_bps),
                "llamacpp": engine_figures(theirs, count, their_bytes, read_bps),
                "ratio": _median(ratios), "turn_ratios": ratios}

    curve = [{"streams": count, **point([row["curve"][i] for row in rows], count)} for i, count in enumerate(streams)]
    error = next((row["paged_hf_error"] for row in rows if row["paged_hf_error"]), None)
    llama_error = next((row["llamacpp_error"] for row in rows if row["llamacpp_error"]), None)
    return {**first, "batch1": point([row["batch1"] for row in rows], 1), "curve": curve,
            "paged_hf_error": error, "llamacpp_error": llama_error}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _total(figures: dict) -> str:
    """'total (per stream)', or '-' where the engine did not run."""
    if figures["total_tokens_per_s"] is None:
        return "-"
    return f"{figures['total_tokens_per_s']:.1f} ({figures['per_stream_tokens_per_s']:.1f})"


def _ratio(figures: dict) -> str:
    """'**1.05x**', and the turns' lowest and highest ratios beside it where there were several."""
    value, turns = figures["ratio"], figures.get("turn_ratios") or []
    if value is None:
        return "-"
    spread = f" ({min(turns):.2f}-{max(turns):.2f})" if len(turns) > 1 else ""
    return f"**{value:.2f}x**{spread}"


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.0f}"


def format_batch1(rows: list[dict]) -> list[str]:
    lines = ["| batch-1 decode | paged_hf tok/s | llama.cpp tok/s (llama-bench) | paged_hf / llama.cpp | "
             "weights read per token, MB (paged_hf / llama.cpp) | of the read limit (paged_hf / llama.cpp) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        ours, theirs = row["batch1"]["paged_hf"], row["batch1"]["llamacpp"]
        lines.append(f"| {row['label']} | {_num(ours['total_tokens_per_s'])} | {_num(theirs['total_tokens_per_s'])} "
                     f"| {_ratio(row['batch1'])} | {_mb(row['paged_hf_step_weight_bytes'])} / "
                     f"{_mb(row['llamacpp_step_weight_bytes'])} | {_pct(ours['read_fraction'])} / "
                     f"{_pct(theirs['read_fraction'])} |")
    return lines


def format_curve(rows: list[dict]) -> list[str]:
    lines = ["| precision | streams | paged_hf tok/s total (per stream) | llama.cpp tok/s total (per stream) | "
             "paged_hf / llama.cpp | of the read limit (paged_hf / llama.cpp) |", "|---|---|---|---|---|---|"]
    for row in rows:
        for point in row["curve"]:
            ours, theirs = point["paged_hf"], point["llamacpp"]
            lines.append(f"| {row['label']} | {point['streams']} | {_total(ours)} | {_total(theirs)} "
                         f"| {_ratio(point)} | "
                         f"{_pct(ours['read_fraction'])} / {_pct(theirs['read_fraction'])} |")
    return lines


def format_memory(rows: list[dict]) -> list[str]:
    """What loading paged_hf added to its process's resident set, beside the weights and the KV cache."""
    lines = ["| paged_hf, loaded | weights MB | KV cache MB | resident set added by loading, MB | "
             "(added - KV cache) / weights | the same after every stream count |", "|---|---|---|---|---|---|"]
    for row in rows:
        memory = row.get("paged_hf_memory")
        if memory:
            after = memory.get("after_streams_over_weights")
            lines.append(f"| {row['label']} | {_mb(memory['weight_bytes'])} | {_mb(memory['kv_cache_bytes'])} | "
                         f"{_mb(memory['load_rss_bytes'])} | {memory['load_over_weights']:.2f}x | "
                         f"{'-' if after is None else format(after, '.2f') + 'x'} |")
    return lines if len(lines) > 2 else []


def _turns(settings: dict) -> str:
    turns = settings.get("turns", 1)
    return f"{turns} turns, the engines' order swapped each turn; " if turns > 1 else ""


def format_report(report: dict) -> str:
    """The two tables (markdown), what was measured where, and every error or skip."""
    settings = report["settings"]
    read = report.get("read_bytes_per_s")
    lines = [f"paged_hf vs llama.cpp on {settings['model']}, {settings['prompt_tokens']}-token prompts, "
             f"{settings['new_tokens']} greedy new tokens (EOS ignored), {settings['threads']} threads; "
             f"{_turns(settings)}{settings['cpu']}; measured read bandwidth {_num(read / 1e9 if read else None)} GB/s; "
             f"{settings['date']}; `{settings['command']}`", ""]
    lines += format_batch1(report["rows"]) + [""] + format_curve(report["rows"])
    memory = format_memory(report["rows"])
    lines += [""] + memory if memory else []
    notes = [f"- {row['precision']}: paged_hf: {row['paged_hf_error']}" for row in report["rows"]
             if row["paged_hf_error"]]
    llama_notes = {row["llamacpp_error"] for row in report["rows"] if row["llamacpp_error"]}
    if len(llama_notes) == 1 and all(row["llamacpp_error"] for row in report["rows"]):  # one reason for all
        notes.append(f"- llama.cpp: {llama_notes.pop()}")
    else:
        notes += [f"- {row['precision']}: llama.cpp: {row['llamacpp_error']}" for row in report["rows"]
                  if row["llamacpp_error"]]
    return "\n".join(lines + ([""] + notes if notes else []))
