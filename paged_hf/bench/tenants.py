"""`paged-hf bench --workload tenants`: two tenants on one engine, under each scheduling policy.

Tenant A sends `--requests` (default 200) long requests at once; tenant B sends one short request every 200 ms
(50 of them by default, all while A's requests run). Each policy gets a fresh engine on the same model: `fcfs`,
`fair` (A and B are the tenants) and `priority` (B's requests at priority -1); B alone (A absent, fcfs) is the
reference for B's TTFT. Reported per tenant: TTFT and TPOT percentiles, and per run the total tok/s (every
generated token over the run's wall time), the preemptions, and the steps that fair and priority shortened for
B's first tokens (un-topped: no prefill of A's beside B's; capped: A's prefill cut short so that the step lasts
at most 1.25 times B's own first step; paged_hf.core.step_pacing).

With `--rounds N` the four runs take turns N times (B alone, fcfs, fair, priority, B alone, ...), so that a slow
spell of a shared host falls on all of them; each run's TTFT and TPOT percentiles are over the requests of all its
rounds, its tok/s the median of the rounds'.

The engine runs in this process through its Python API (no HTTP), so the figures are the scheduler's: a
request's TTFT runs from its planned arrival to the end of the step that gave its first token, so it includes
the wait for a step that was running when it arrived. Greedy, EOS ignored: every run does the same work.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import paged_hf
from paged_hf.bench.workloads import (
    CORPUS_MODULES,
    QUESTION_TEMPLATES,
    chat_prompt,
    corpus_token_ids,
    module_docs,
    passage,
)
from paged_hf.loader import default_model
from paged_hf.utils import cpu_model_name, describe_host, percentile

RUNS = (("B alone", "fcfs"), ("fcfs", "fcfs"), ("fair", "fair"), ("priority", "priority"))
B_INTERVAL_S = 0.2


@dataclass
class TenantsWorkload:
    a_prompts: list[list[int]]
    a_new_tokens: int
    b_prompts: list[list[int]]
    b_new_tokens: int
    b_interval_s: float = B_INTERVAL_S

    def describe(self) -> str:
        a_len = sum(map(len, self.a_prompts)) // max(1, len(self.a_prompts))
        b_len = sum(map(len, self.b_prompts)) // max(1, len(self.b_prompts))
        return (f"tenant A: {len(self.a_prompts)} requests at once (~{a_len} prompt + {self.a_new_tokens} new tokens); "
                f"tenant B: {len(self.b_prompts)} requests, one every {self.b_interval_s * 1000:.0f} ms (~{b_len} "
                f"prompt + {self.b_new_tokens} new tokens); greedy, EOS ignored")


def build_tenants(tokenizer, seed: int = 0, num_a: int = 200, num_b: int = 50, a_prompt_tokens: int = 400,
                  a_new_tokens: int = 128, b_new_tokens: int = 16) -> TenantsWorkload:
    """A: a passage of the corpus to summarize (long); B: a one-line question about a name (short)."""
    rng = random.Random(seed)
    corpus = corpus_token_ids(tokenizer)
    overhead = len(chat_prompt(tokenizer, "Summarize:"))
    a_prompts = [chat_prompt(tokenizer, "Summarize:\n\n" + passage(tokenizer, corpus, a_prompt_tokens - overhead, rng))
                 for _ in range(num_a)]
    names = [n for m in CORPUS_MODULES for n in module_docs(m)[1]]
    b_prompts = [chat_prompt(tokenizer, rng.choice(QUESTION_TEMPLATES).format(name=rng.choice(names)))
                 for _ in range(num_b)]
    return TenantsWorkload(a_prompts, a_new_tokens, b_prompts, b_new_tokens)


@dataclass
class Record:
    tenant: str
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    num_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.num_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.num_tokens - 1)


@dataclass
class Arrival:
    at: float  # seconds after the run's start
    tenant: str
    prompt: list[int]
    max_new_tokens: int
    priority: int = 0


def arrivals(workload: TenantsWorkload, with_a: bool, policy: str) -> list[Arrival]:
    """A's requests at 0 s, B's every interval from 0 s (priority -1 under the priority policy)."""
    plan = [Arrival(0.0, "A", p, workload.a_new_tokens) for p in workload.a_prompts] if with_a else []
    plan += [Arrival(i * workload.b_interval_s, "B", p, workload.b_new_tokens, -1 if policy == "priority" else 0)
             for i, p in enumerate(workload.b_prompts)]
    return sorted(plan, key=lambda a: a.at)


def drive(generator, plan: list[Arrival]) -> tuple[dict[str, Record], float]:
    """Submit each request at its time, step until all finished -> (records by request id, wall seconds)."""
    records: dict[str, Record] = {}
    pending = list(plan)
    start = time.perf_counter()
    while pending or generator.has_unfinished_requests():
        now = time.perf_counter()
        while pending and start + pending[0].at <= now:
            item = pending.pop(0)
            params = paged_hf.SamplingParams(max_new_tokens=item.max_new_tokens, temperature=0, ignore_eos=True)
            rid = generator.add_request(item.prompt, params, tenant=item.tenant, priority=item.priority)
            records[rid] = Record(item.tenant, start + item.at)
        if not generator.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0].at - time.perf_counter()))
            continue
        outputs = generator.step()
        now = time.perf_counter()
        for output in outputs:
            record = records[output.request_id]
            record.num_tokens = len(output.outputs[0].token_ids)
            if record.num_tokens and record.first_token is None:
                record.first_token = now
            if output.finished:
                record.finish = now
    return records, time.perf_counter() - start


def _percentiles(values: list) -> dict:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def summarize(rounds: list[tuple[dict[str, Record], float]]) -> dict:
    """One run's rounds ((records, wall s) each) -> per tenant the requests and tokens of one round, the
    percentiles over all rounds' requests (and each round's TTFT p99); tok/s the median of the rounds'."""
    records = [r for round_records, _ in rounds for r in round_records.values()]
    tenants = {}
    for tenant in sorted({r.tenant for r in records}):
        mine = [r for r in records if r.tenant == tenant]
        tenants[tenant] = {"num_requests": len(mine) // len(rounds), "tokens": sum(r.num_tokens for r in mine)
                           // len(rounds), "ttft_s": _percentiles([r.ttft for r in mine]),
                           "tpot_s": _percentiles([r.tpot for r in mine]),
                           "rounds_ttft_p99_s": [percentile([r.ttft for r in rs.values() if r.tenant == tenant], 99)
                                                 for rs, _ in rounds]}
    tok_s = [sum(r.num_tokens for r in rs.values()) / wall if wall > 0 else 0.0 for rs, wall in rounds]
    walls = [wall for _, wall in rounds]
    return {"wall_s": statistics.median(walls), "walls_s": walls,
            "tokens": sum(r.num_tokens for r in records) // len(rounds), "tok_s": statistics.median(tok_s),
            "rounds_tok_s": tok_s, "tenants": tenants}


def run_once(model, config: dict, workload: TenantsWorkload, name: str, policy: str) -> dict:
    """One run on a fresh engine -> records, wall s, preemptions and the pacer's short steps."""
    generator = paged_hf.ContinuousBatchGenerator(model, paged_hf.PagedConfig(**config, scheduling_policy=policy))
    generator.generate([workload.b_prompts[0]], paged_hf.SamplingParams(max_new_tokens=2), use_tqdm=False)
    records, wall = drive(generator, arrivals(workload, name != "B alone", policy))
    pacer = generator.scheduler.pacer  # short steps for first prefills in a hurry (None under fcfs)
    print(f"[paged-hf bench] {name}: {wall:.1f} s", file=sys.stderr, flush=True)
    return {"records": records, "wall": wall, "num_preemptions": generator.stats()["num_preemptions"],
            "paced_steps": None if pacer is None else (pacer.num_untopped_steps, pacer.num_capped_steps)}


def run_tenants_bench(args) -> int:
    """Every run of RUNS on one model; prints the table, writes tenants_bench.json to --out."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = default_model.load_model(args.model, getattr(torch, args.dtype), args.device)
    max_len = getattr(model.config, "max_position_embeddings", None) or 2048
    scale = args.max_new_tokens_scale or 1.0
    num_a = args.requests or 200
    workload = build_tenants(tokenizer, args.seed, num_a=num_a, num_b=min(50, max(2, num_a // 4)),
                             a_prompt_tokens=min(400, max_len // 2), a_new_tokens=max(1, round(128 * scale)),
                             b_new_tokens=max(2, round(16 * scale)))
    print(f"[paged-hf bench] tenants: {workload.describe()}", file=sys.stderr, flush=True)
    config = dict(args.engine_config)
    config.pop("scheduling_policy", None)
    argv = getattr(args, "argv", None)
    report = {"workload": workload.describe(), "engine_config": config, "host": describe_host(),
              "cpu": cpu_model_name(), "date": time.strftime("%Y-%m-%d"), "device": args.device, "dtype": args.dtype,
              "command": "paged-hf " + shlex.join(argv) if argv is not None else "paged-hf bench", "runs": {}}
    num_rounds = max(1, getattr(args, "rounds", 1) or 1)
    report["rounds"] = num_rounds
    runs: dict[str, list[dict]] = {name: [] for name, _ in RUNS}
    for number in range(num_rounds):
        if num_rounds > 1:
            print(f"[paged-hf bench] round {number + 1} of {num_rounds}", file=sys.stderr, flush=True)
        for name, policy in RUNS:
            runs[name].append(run_once(model, config, workload, name, policy))
    for name, rounds in runs.items():
        report["runs"][name] = summary = summarize([(run["records"], run["wall"]) for run in rounds])
        summary["num_preemptions"] = sum(run["num_preemptions"] for run in rounds) // num_rounds
        paced = [run["paced_steps"] for run in rounds]
        summary["paced_steps"] = None if paced[0] is None else {"untopped": sum(p[0] for p in paced) // num_rounds,
                                                                "capped": sum(p[1] for p in paced) // num_rounds}
    print(format_table(report), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tenants_bench.json"), "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


def format_table(report: dict) -> str:
    def ms(value) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [f"tenants: {report['workload']}", f"on {report['host']}", "",
             "| run | tenant | requests | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p99 (ms) | total tok/s "
             "| preemptions | un-topped / capped steps |", "|---|---|---|---|---|---|---|---|"]
    for name, run in report["runs"].items():
        paced = run.get("paced_steps")
        paced = "-" if paced is None else f"{paced['untopped']} / {paced['capped']}"
        for tenant, t in run["tenants"].items():
            ttft, tpot = t["ttft_s"], t["tpot_s"]
            lines.append(f"| {name} | {tenant} | {t['num_requests']} | {ms(ttft['p50'])} / {ms(ttft['p90'])} / "
                         f"{ms(ttft['p99'])} | {ms(tpot['p50'])} / {ms(tpot['p99'])} | {run['tok_s']:.1f} | "
                         f"{run['num_preemptions']} | {paced} |")
    return "\n".join(lines + ratio_lines(report))


def ratio_lines(report: dict) -> list[str]:
    """B's TTFT p99 against B alone's and tok/s against fcfs's, for fair and priority (issue 31's measure); with
    rounds, every round's tok/s."""
    runs = report["runs"]
    lines = [""]
    if report.get("rounds", 1) > 1:
        lines.append(f"{report['rounds']} rounds, the runs taking turns: TTFT and TPOT over all rounds' requests; "
                     "tok/s the median of the rounds' (each round: " + "; ".join(
                         f"{name} {', '.join(f'{v:.1f}' for v in run['rounds_tok_s'])}" for name, run in runs.items())
                     + "); requests, preemptions and steps a round's")
    alone, fcfs = runs.get("B alone"), runs.get("fcfs")
    if alone and fcfs and alone["tenants"]["B"]["ttft_s"]["p99"] and fcfs["tok_s"]:
        for name in ("fair", "priority"):
            if name in runs:
                b, b_alone = runs[name]["tenants"]["B"], alone["tenants"]["B"]
                each = "" if len(b["rounds_ttft_p99_s"]) < 2 else " (each round against its own: " + ", ".join(
                    f"{p / q:.2f}x" for p, q in zip(b["rounds_ttft_p99_s"], b_alone["rounds_ttft_p99_s"])) + ")"
                lines.append(f"{name}: B's TTFT p99 {b['ttft_s']['p99'] / b_alone['ttft_s']['p99']:.2f}x B alone's"
                             f"{each}; total tok/s {100 * runs[name]['tok_s'] / fcfs['tok_s']:.1f}% of fcfs's")
    return lines
