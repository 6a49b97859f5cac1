"""The report of `python -m kvbridge bench-scheduler`: the two engines side by side with ratios (ours /
llama-server), one row per request, and the JSON of the whole result. No target is judged here.
"""
from __future__ import annotations

from pathlib import Path

from kvbridge.bench.common.report import write_result_json
from kvbridge.bench.scheduler_compare import EXACT, NO_FA, OURS, THEIRS


def format_bench_scheduler(result: dict) -> str:
    from kvbridge.bench.scheduler_bench import format_swap_vs_recompute

    sections = []
    if "swap" in result:
        sections.append(format_swap_vs_recompute(result["swap"]))
    if "burst" in result:
        sections.append(format_priority_burst(result["burst"]))
    if "shared" in result:
        sections.append(format_shared_system_prompt(result["shared"]))
    return "\n\n".join(sections)


def format_priority_burst(result: dict) -> str:
    return _format(result, [
        ("urgent TTFT median (ms)", "urgent_ttft_median_ms"),
        ("urgent TTFT p95 (ms)", "urgent_ttft_p95_ms"),
        ("low TTFT median (ms)", "low_ttft_median_ms"),
        ("throughput (generated tokens/s)", "throughput_tok_s"),
        ("generated tokens", "gen_tokens"),
        ("wall time (s)", "wall_s"),
        ("requests completed", "completed"),
        ("preemptions", "preemptions"),
        ("KV cells used, peak", "peak_cells"),
    ])


def format_shared_system_prompt(result: dict) -> str:
    shared = result["figures"][OURS]["shared_tokens"]
    return _format(result, [
        ("KV cells used, peak", "peak_cells"),
        ("requests completed", "completed"),
        (f"reused all {shared} shared tokens", "reused_whole_shared"),
        (f"computed >= {shared} prompt tokens", "computed_whole_shared"),
        ("shared-prompt tokens computed", "shared_tokens_computed"),
        ("throughput (generated tokens/s)", "throughput_tok_s"),
        ("generated tokens", "gen_tokens"),
        ("wall time (s)", "wall_s"),
    ])


def _format(result: dict, rows: list[tuple[str, str]]) -> str:
    w, figures, ratio = result["workload"], result["figures"], result["ratios"]
    lines = [f"{w['title']}: {len(w['requests'])} requests on {w['kv_cells']} KV cells over {w['max_running']} "
             f"running sequences, threads {w['threads']} (llama-server -c {w['kv_cells']} -np {w['max_running']} "
             f"--kv-unified -t {w['threads']}, its defaults otherwise)",
             f"  {'':36}{'ours':>12}{'llama-server':>14}{'ours / llama-server':>21}"]
    for title, key in rows:
        lines.append(f"  {title:36}{_fmt(figures[OURS][key]):>12}{_fmt(figures[THEIRS][key]):>14}"
                     f"{_fmt_ratio(ratio.get(key)):>21}")
    lines.append(f"  {'per request':24}{'prio':>5}{'at s':>6} | {'ours: TTFT ms':>13}{'gen':>5}{'computed':>9}"
                 f"{'reused':>7}{'preempt':>8} | {'llama-server: TTFT ms':>21}{'gen':>5}{'computed':>9}{'reused':>7}")
    ours, theirs = result["runs"][OURS]["requests"], result["runs"][THEIRS]["requests"]
    for a, b in zip(ours, theirs):
        lines.append(f"  {a['label'][:24]:24}{a['priority']:>5}{a['submitted_s']:>6.1f} | {_fmt(a['ttft_ms']):>13}"
                     f"{a['gen_tokens']:>5}{a['computed_tokens']:>9}{a['reused_tokens']:>7}{a['preemptions']:>8} | "
                     f"{_fmt(b['ttft_ms']):>21}{b['gen_tokens']:>5}{b['computed_tokens']:>9}{b['reused_tokens']:>7}")
    for engine, requests_ in ((OURS, ours), (THEIRS, theirs)):
        lines += [f"  {engine} {r['label']} failed: {r['error']}" for r in requests_ if r["error"]]
    if "exact" in result:
        lines += _format_exact(result, rows)
    return "\n".join(lines)


def _format_exact(result: dict, rows: list[tuple[str, str]]) -> list[str]:
    """--exact: the scheduler with KVB_SCHED_EXACT=1 beside itself with the mode off, and the answers that equal
    their solo runs in each."""
    figures, exact = result["figures"], result["exact"]
    lines = ["  KVB_SCHED_EXACT=1 (flash attention off) against the mode off (above, flash attention on) and the mode off "
             "with flash attention off too (its kernels):",
             f"  {'':36}{'exact':>12}{'exact / off':>14}{'off, no FA':>12}{'exact / off, no FA':>20}"
             f"{'exact / llama-server':>22}"]
    for title, key in rows:
        lines.append(f"  {title:36}{_fmt(figures[EXACT][key]):>12}{_fmt_ratio(exact['exact_vs_off'].get(key)):>14}"
                     f"{_fmt(figures[NO_FA][key]):>12}"
                     f"{_fmt_ratio(exact['exact_vs_off_flash_attention_off'].get(key)):>20}"
                     f"{_fmt_ratio(exact['exact_vs_llama_server'].get(key)):>22}")
    for name, (equal, done) in exact["solo_equal"].items():
        lines.append(f"  {name}: {equal} of {done} answers equal the same request run alone")
    lines += [f"  {name} {r['label']} failed: {r['error']}" for name in (EXACT, NO_FA)
              for r in result["runs"][name]["requests"] if r["error"]]
    return lines


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}x"


def write_json(result: dict, output_dir) -> Path:
    """The whole result (every request of both engines) as JSON in output_dir."""
    return write_result_json(result, output_dir, "bench-scheduler")
