"""bench-fleet's report: the table it prints, the markdown table and the JSON it writes to KVB_OUTPUT_DIR.

Place in the flow: kvbridge.bench.fleet_bench measures; this module only reads its result (plain data).
"""
from __future__ import annotations

from pathlib import Path

from kvbridge.bench.common.report import write_result_json

PD_NAMES = ("pd", "colocated")


def _f(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def _label(result: dict, name: str) -> str:
    run, s = result["runs"][name], result["setup"]
    if name == "single":
        return f"single instance, {s['single_kv_cells']} cells"
    if name == "pd":
        return "PD: 1 prefill + 1 decode"
    if name == "colocated":
        return "colocated: 1 instance"
    mode = {True: ", exact", False: ", mode off (flash attention on)", None: ""}[getattr(run, "exact", None)]
    return f"{run.policy}, shared cache {'on' if run.shared_cache else 'off'}{mode}"


def _answered_by(fig: dict) -> str:
    return " ".join(f"{name.removeprefix('worker-')}:{n}" for name, n in sorted(fig["by_instance"].items()))


def _equal(fig: dict) -> str:
    return f"{fig['answers_compared'] - len(fig['answers_differ'])}/{fig['answers_compared']}"


def rows(result: dict) -> list[dict]:
    """One row per fleet: the columns both tables show."""
    out = []
    for name, fig in result["figures"].items():
        pd = name in PD_NAMES
        out.append({"fleet": _label(result, name), "hit rate": _f(fig["hit_rate"], ".1%") if not pd else "-",
                    "mean TTFT ms": _f(fig["mean_ttft_ms"]), "median TTFT ms": _f(fig["median_ttft_ms"]),
                    "TPOT ms": _f(fig["median_time_per_output_token_ms"], ".1f") if pd else "-",
                    "tokens/s": _f(fig["completion_tokens_per_s"], ".1f") if not pd else "-",
                    "requests/s": _f(fig["requests_per_s"], ".2f") if not pd else "-",
                    "instances/doc": _f(fig["instances_per_document"], ".2f") if not pd else "-",
                    "answered by": _answered_by(fig), "= cold": _equal(fig),
                    "note": fig["error"][:60] if fig["error"] else ""})
    return out


def target_lines(result: dict) -> list[str]:
    r, fig = result["ratios"], result["figures"]
    hit, rr_ttft, rr_hit = r["kv_aware_hit_vs_single"], r["round_robin_no_shared_ttft_vs_kv_aware"], \
        r["round_robin_hit_rate"]
    lines = [
        f"kv_aware hit rate / one instance with all the memory: {_f(hit['shared'], '.2f')} with the shared cache "
        f"server, {_f(hit['no-shared'], '.2f')} without (target >= 0.90)",
        f"round_robin without a shared cache, mean TTFT / kv_aware's: {_f(rr_ttft['shared'], '.2f', 'x')} "
        f"(kv_aware with the shared cache server), {_f(rr_ttft['no-shared'], '.2f', 'x')} (kv_aware without) "
        f"(target >= 2x)",
        f"round_robin with the shared cache server: hit rate {_f(rr_hit['shared'], '.1%')} against "
        f"{_f(rr_hit['no-shared'], '.1%')} without; mean TTFT with / without "
        f"{_f(r['round_robin_ttft_shared_vs_no_shared'], '.2f', 'x')}",
    ]
    for name, ratio in r.get("exact_vs_off_tokens_per_s", {}).items():
        lines.append(f"{name}: tokens/s in exact mode / the mode off (flash attention on): {_f(ratio, '.2f', 'x')} "
                     f"(target >= 0.8x); answers equal to cold {_equal(fig[name])} exact, "
                     f"{_equal(fig[name + ' (mode off)'])} mode off")
    if "pd" in fig:
        lines.append(
            f"PD on a warm prefix, median TTFT / colocated: {_f(r['pd_ttft_vs_colocated'], '.2f', 'x')} "
            f"({_f(fig['pd']['median_ttft_ms'])} ms against {_f(fig['colocated']['median_ttft_ms'])} ms; target "
            f"<= 1.3x); time per output token {_f(fig['pd']['median_time_per_output_token_ms'], '.1f')} ms against "
            f"{_f(fig['colocated']['median_time_per_output_token_ms'], '.1f')} ms "
            f"({_f(r['pd_time_per_output_token_vs_colocated'], '.2f', 'x')})")
    return lines


def _header(result: dict) -> list[str]:
    s = result["setup"]
    n = len(result["order"])
    return [
        f"bench-fleet: {s['workers']} serve workers behind vllm-router, {result['documents']} documents x "
        f"{result['questions_per_document']} questions ({n} requests, interleaved, seed {result['seed']}, "
        f"{s['client_threads']} client threads, {s['think_s']:g} s between a user's answer and next question), "
        f"openai SDK {s['openai_sdk']}, streaming, temperature 0, max_tokens {result['max_tokens']}",
        f"  {s['model']}, chunk {s['chunk_size']}, prompts up to ~{s['longest_prompt_tokens']} tokens; a worker: "
        f"{s['worker_kv_cells']} KV cells and {_mib(s['worker_l1_bytes'])} L1 (~2 documents each), context "
        f"{s['ctx_size']}, {s['threads_per_worker']} thread(s), {s['kv_type']} K/V, "
        f"{s['max_running_per_worker']} running, no resident cached prefixes, no L2; {s.get('exact', 'mode off')}",
        f"  the single instance: {s['single_kv_cells']} cells, {_mib(s['single_l1_bytes'])} L1; the shared cache "
        f"server's pool: {_mib(s['shared_pool_bytes'])} (the workers' L1 together)",
        f"  hit rate = sum(cached_tokens) / sum(prompt_tokens); TTFT: the client's, to the first content chunk; "
        f"cold answers: {s['cold_runs']}",
    ]


def format_bench_fleet(result: dict) -> str:
    table = rows(result)
    columns = list(table[0]) if table else []
    widths = {c: max(len(c), *(len(row[c]) for row in table)) for c in columns}
    lines = _header(result) + ["", "  ".join(f"{c:{widths[c]}}" for c in columns).rstrip()]
    lines += ["  ".join(f"{row[c]:{widths[c]}}" for c in columns).rstrip() for row in table]
    lines += ["", "Targets, as ratios of this one run:"] + [f"  {line}" for line in target_lines(result)]
    for name, run in result["runs"].items():
        if run.error:
            lines.append(f"{name}: {run.error[:500]}")
        for key in result["figures"][name]["answers_differ"]:
            lines.append(f"{name}, {key}: the answer differs from its cold run")
    for key, answer in result["cold"].items():
        if answer.error:
            lines.append(f"cold run {key}: {answer.error[:300]}")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    table = rows(result)
    if not table:
        return ""
    columns = [c for c in table[0] if c != "note"]
    lines = [*(f"{line.strip()}  " for line in _header(result)), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in table]
    lines += [""] + [f"- {line}" for line in target_lines(result)]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, output_dir) -> tuple[Path, Path]:
    """The JSON and, beside it with the same name, the markdown table."""
    path = write_result_json(result, output_dir, "bench-fleet")
    md = path.with_suffix(".md")
    md.write_text(markdown(result), encoding="utf-8")
    return path, md
