"""`paged-hf bench --streams 1,2,4,8,16`: paged_hf against llama.cpp on the same model at every precision.

Why: most people run a model on their own machine one chat at a time, with llama.cpp or a tool built on it; this
is the comparison they would make. For each precision (float32, bfloat16, int8 against Q8_0, w4a16 against
Q4_0; :data:`.peer_report.PRECISIONS`), one after the other on the same host:

- paged_hf in a fresh process (:mod:`.peer_paged`, through ``paged_hf.LLM``): every stream count;
- llama.cpp on the model converted to GGUF (:mod:`.llamacpp_gguf`, cached): ``llama-bench`` at batch 1 and
  ``llama-batched-bench`` at every stream count (:mod:`.llamacpp`), with as many threads as paged_hf's torch.

Then the machine's streaming read rate is measured (nothing else of ours running), and :mod:`.peer_report`
prints per-stream and total tok/s, the ratios and each engine's fraction of the memory-read limit. Without a
llama.cpp build (`make bench-llamacpp`) the bench says how to build one and runs paged_hf alone.

`--rounds N` makes that N turns, the engines' order swapped each turn: a host whose read rate drifts by tens of
percent within minutes (a shared VM) moves both engines of one turn alike, so the ratio reported is the median
of the turns' own ratios (:func:`.peer_report.combine_turns`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from paged_hf.bench import machine, measured_where
from paged_hf.bench.llamacpp import LlamaCpp, find_llamacpp, run_batched_bench, run_llama_bench
from paged_hf.bench.llamacpp_gguf import gguf_file, model_folder, step_weight_bytes
from paged_hf.bench.model_shapes import resolve_model_shape
from paged_hf.bench.peer_plot import write_curve_plot
from paged_hf.bench.peer_report import PRECISIONS, combine_turns, format_report, precision_rows
from paged_hf.bench.systems import stderr_fd

PROMPT_TOKENS, NEW_TOKENS, ROUNDS = 32, 128, 3
REPORT_FILE = "bench_llamacpp.json"


def add_peer_args(parser) -> None:
    """The flags of this comparison (`--streams` itself is declared with the bench's others)."""
    group = parser.add_argument_group("bench --streams: paged_hf against llama.cpp (paged_hf.bench.peer)")
    group.add_argument("--precisions", default=",".join(PRECISIONS),
                       help=f"comma list of {', '.join(PRECISIONS)} (default: all)")
    group.add_argument("--llamacpp-dir", default=None, metavar="DIR",
                       help="where `make bench-llamacpp` built llama.cpp (default: .llamacpp)")


def parse_counts(text: str) -> list[int]:
    """'2,4,1' -> [1, 2, 4] (sorted, each once); 1 is always among them: the batch-1 table is made of it."""
    counts = {int(part) for part in str(text).split(",") if part.strip()}
    if not counts or min(counts) < 1:
        raise ValueError(f"--streams takes stream counts >= 1, e.g. 1,2,4,8,16; got {text!r}")
    return sorted(counts | {1})


def parse_precisions(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in PRECISIONS]
    if unknown or not names:
        raise ValueError(f"unknown precision(s) {unknown}; known: {', '.join(PRECISIONS)}")
    return list(dict.fromkeys(names))


def _log(message: str) -> None:
    print(f"[paged-hf bench] {message}", file=sys.stderr, flush=True)


def run_paged(model: str | None, precision: str, streams: list[int], threads: int, timeout_s: float | None) -> dict:
    """paged_hf at one precision, every stream count, in a fresh process (:mod:`.peer_paged`)."""
    _log(f"{precision}: paged_hf, streams {streams} ...")
    dtype, quantization, _ = PRECISIONS[precision]
    with tempfile.TemporaryDirectory(prefix="paged_hf_bench_peer_") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        spec = {"model": model, "dtype": dtype, "quantization": quantization, "threads": threads,
                "streams": streams, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "rounds": ROUNDS,
                "seed": 0, "result_path": result_path}
        Path(spec_path).write_text(json.dumps(spec))
        try:
            proc = subprocess.run([sys.executable, "-m", "paged_hf.bench.peer_paged", spec_path],
                                  stdout=stderr_fd(), timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s} s"}
        if not os.path.exists(result_path):
            return {"error": f"worker exited with code {proc.returncode} and no result"}
        return json.loads(Path(result_path).read_text())


def run_llamacpp(build: LlamaCpp, folder: Path, precision: str, streams: list[int], threads: int,
                 timeout_s: float | None) -> dict:
    """llama.cpp at one precision: the GGUF file (converted once), llama-bench at batch 1, llama-batched-bench."""
    gguf_type = PRECISIONS[precision][2]
    _log(f"{precision}: llama.cpp ({gguf_type}) ...")
    try:
        gguf = gguf_file(build, folder, gguf_type, timeout_s)
        result = {"gguf": str(gguf), "step_weight_bytes": step_weight_bytes(build, gguf)["step_weight_bytes"]}
        result["bench"] = run_llama_bench(build, gguf, threads, NEW_TOKENS, ROUNDS, timeout_s)
        batched = run_batched_bench(build, gguf, threads, streams, ROUNDS, PROMPT_TOKENS, NEW_TOKENS, timeout_s)
        result["batched"] = {str(count): row for count, row in batched.items()}
        return result
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def turn_count(args) -> int:
    """`--rounds`: how many turns of the whole comparison (1 where unset)."""
    return max(1, getattr(args, "rounds", 1) or 1)


def run_turn(args, precisions: list[str], streams: list[int], threads: int, build: LlamaCpp | None, reason: str,
             llama_first: bool) -> dict:
    """Both engines at every precision, one after the other -> {precision: {"paged_hf": ..., "llamacpp": ...}}."""
    folder = model_folder(args.model) if build else None
    order = ("llamacpp", "paged_hf") if llama_first else ("paged_hf", "llamacpp")
    results = {}
    for precision in precisions:
        ran = {}
        for engine in order:
            if engine == "paged_hf":
                ran[engine] = run_paged(args.model, precision, streams, threads, args.system_timeout)
            else:
                ran[engine] = run_llamacpp(build, folder, precision, streams, threads, args.system_timeout) \
                    if build else {"skipped": reason}
        results[precision] = {"paged_hf": ran["paged_hf"], "llamacpp": ran["llamacpp"]}
    return results


def _measure_read_bandwidth() -> float | None:
    try:
        return machine.read_bandwidth()
    except RuntimeError as exc:  # context, not the benchmark: report and go on
        _log(f"could not measure the read bandwidth: {exc}")
        return None


def _settings(args, streams: list[int], threads: int, build: LlamaCpp | None, load_before: list[float]) -> dict:
    """What ran where; the 1-minute load average before and after (a busy machine slows both engines, llama.cpp's
    spinning threads the most)."""
    return {"model": args.model or "SmolLM2-135M-Instruct (default)", "streams": streams, "threads": threads,
            "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "rounds": ROUNDS,
            "turns": turn_count(args),
            "llamacpp": str(build.root) if build else None, "load_average_before": load_before,
            "load_average_after": list(os.getloadavg()), **measured_where(args)}


def run_peer_bench(args) -> int:
    """Every precision, paged_hf then llama.cpp (`--rounds` turns of it); the read bandwidth after each turn; the
    tables. 0 if everything ran (llama.cpp missing counts as ran: it is reported and skipped), 1 if anything
    failed."""
    streams, precisions = parse_counts(args.streams), parse_precisions(args.precisions)
    resolve_model_shape(args)  # --model-shape: its folder in --dtype, built once; every precision loads from it
    threads, load_before = args.threads or torch.get_num_threads(), list(os.getloadavg())
    build, reason = find_llamacpp(args.llamacpp_dir)
    if reason:
        _log(f"{reason}; running paged_hf alone")
    turns, read_rates = [], []
    for turn in range(turn_count(args)):
        # llama.cpp first every other turn: a steady drift of the host favours neither engine
        turns.append(run_turn(args, precisions, streams, threads, build, reason, llama_first=turn % 2 == 1))
        torch.set_num_threads(threads)
        read_rates.append(_measure_read_bandwidth())
    measured = [rate for rate in read_rates if rate]
    read_bps = statistics.median(measured) if measured else None
    rows = [combine_turns([precision_rows(p, t[p]["paged_hf"], t[p]["llamacpp"], streams, read_bps) for t in turns],
                          streams, read_bps) for p in precisions]
    report = {"settings": _settings(args, streams, threads, build, load_before), "read_bytes_per_s": read_bps,
              "read_bytes_per_s_turns": read_rates, "rows": rows, "turns": turns}
    print(format_report(report), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, REPORT_FILE)
        Path(path).write_text(json.dumps(report, indent=1))
        _log(f"wrote {path}")
        plot = write_curve_plot(report, args.out)
        if plot:
            _log(f"wrote {plot}")
    return 1 if any(r["paged_hf"].get("error") or r["llamacpp"].get("error")
                    for results in turns for r in results.values()) else 0
