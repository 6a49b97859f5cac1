"""`python -m kvbridge.models.matrix`: the compatibility matrix, run on the model zoo and written down.

Place in the flow: zoo models (zoo_model) -> for each architecture: the in-process engine's layout
(bytes per token) and, with --bench, its speed figures (matrix_bench.py) -> each path's oracle
(matrix_paths.py) -> the rows merged into the JSON (kvbridge/models/compatibility.json ships with the
package; matrix_rows.py reads it for `kvbridge namespace` and the GUI) -> the page (matrix_report.py).

    python -m kvbridge.models.matrix --size test --json kvbridge/models/compatibility.json --out Docs/Compatibility.md
    python -m kvbridge.models.matrix --size bench --bench --paths none --archs lfm2,gemma2 --json ... --out ...

Rows merge: a run replaces the rows it ran and keeps the others, so the matrix can be made a few
architectures at a time, and the page is rendered from the whole JSON each time (--render-only
renders it without running anything).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
from pathlib import Path

from kvbridge.errors import KVBridgeError
from kvbridge.models.catalog import ZOO_ARCHITECTURES, zoo_arch
from kvbridge.models.matrix_bench import capture_cost, layout_facts, ttft_figures
from kvbridge.models.matrix_paths import PATHS, base_settings, in_process_engine, prompt_of, run_path
from kvbridge.models.matrix_report import kept_part, render_markdown
from kvbridge.models.matrix_rows import FORMAT
from kvbridge.models.matrix_oracle import Row
from kvbridge.settings.cmdline import Parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="python -m kvbridge.models.matrix", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("test", "bench"), default="test", help="zoo model size (default test)")
    parser.add_argument("--archs", default="", help="comma-separated architectures (default: the whole zoo)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated paths of {', '.join(PATHS)}, or 'none' (default: all)")
    parser.add_argument("--bench", action="store_true", help="also measure TTFT and capture cost in-process")
    parser.add_argument("--repeats", type=int, default=3, help="--bench: alternated repeats per figure (default 3)")
    parser.add_argument("--chunk-size", type=int, default=0,
                        help="--bench: the chunk size to measure with (default: 32 at test size, 256 at bench)")
    parser.add_argument("--json", type=Path, help="merge the rows into this JSON (made if missing)")
    parser.add_argument("--out", type=Path, help="write the markdown page here (from the whole JSON)")
    parser.add_argument("--render-only", action="store_true", help="run nothing: render --json into --out")
    parser.add_argument("--workdir", type=Path, help="stores and servers' files (default: a temporary folder)")
    args = parser.parse_args(argv)
    known = [a.name for a in ZOO_ARCHITECTURES]
    args.arch_list = [a.strip() for a in args.archs.split(",") if a.strip()] or known
    for name in args.arch_list:
        zoo_arch(name)   # an unknown name fails here, naming the known ones
    args.path_list = [] if args.paths.strip() == "none" else [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in args.path_list if p not in PATHS]
    if unknown:
        parser.error(f"--paths: unknown {', '.join(unknown)}; the paths are {', '.join(PATHS)} (or none)")
    if args.render_only and not (args.json and args.out):
        parser.error("--render-only needs --json (the matrix to read) and --out (the page to write)")
    return args


def load_json(path: Path | None) -> dict:
    if path is not None and path.is_file():
        data = json.loads(path.read_text())
        if data.get("format") == FORMAT:
            return data
    return {"format": FORMAT, "paths": list(PATHS), "runs": [], "architectures": {}}


def arch_entry(data: dict, arch: str) -> dict:
    entry = zoo_arch(arch)
    row = data["architectures"].setdefault(arch, {})
    row.update(family=entry.family, kv_shape=entry.kv_shape)
    row.setdefault("paths", {})
    row.setdefault("layout", {})
    return row


def measure_arch(model: Path, workdir: Path, size: str, bench: bool, repeats: int,
                 chunk_size: int | None = None) -> tuple[dict, dict]:
    """The in-process engine's layout facts and, with bench, its speed figures."""
    changes = {"chunk_size": chunk_size} if chunk_size else {}
    with in_process_engine(base_settings(model, workdir, size, **changes)) as engine:
        facts = layout_facts(engine)
        figures = {}
        if bench and not engine.kv_refusal:
            ttft = ttft_figures(engine, prompt_of(size), repeats)   # first: it warms both kinds of prefill up
            figures = {"ttft": ttft, "capture": capture_cost(engine, prompt_of(size), repeats)}
    return facts, figures


def run_arch(data: dict, arch: str, args, workdir: Path, stamp: str) -> None:
    from kvbridge.models.cache import zoo_model

    row = arch_entry(data, arch)
    entry = zoo_arch(arch)
    try:
        if entry.load_error:
            raise KVBridgeError(f"llama.cpp will not load it: {entry.load_error}")
        model = zoo_model(arch, args.size)
        facts, figures = measure_arch(model, workdir / arch / "facts", args.size, args.bench, args.repeats,
                                      args.chunk_size)
    except (KVBridgeError, OSError, ValueError) as exc:
        reason = f"the zoo model does not load: {exc}"
        row["layout"][args.size] = {"load_error": reason}
        for path in args.path_list:
            row["paths"][path] = {**Row(arch, path).refuse(reason).as_dict(), "size": args.size, "date": stamp}
        print(f"{arch:14} refused on every path: {reason}", flush=True)
        return
    row["layout"][args.size] = facts
    if figures:
        row["bench"] = {**figures, "size": args.size, "date": stamp}
        t = figures["ttft"]
        print(f"{arch:14} bench: {json.dumps(t.get('ttft_ms', t))} capture {figures['capture'].get('cost_pct', '-')} %",
              flush=True)
    for path in args.path_list:
        result = run_path(arch, path, model, workdir / arch / path, args.size)
        row["paths"][path] = {**result.as_dict(), "size": args.size, "date": stamp}
        print(f"{arch:14} {path:13} {result.verdict}: {result.reason[:160]} ({result.seconds:.0f} s)", flush=True)


def ordered(data: dict) -> dict:
    """Architectures in the zoo's order, paths in the matrix's order, whatever order the runs came in."""
    known = [a.name for a in ZOO_ARCHITECTURES]
    archs = data["architectures"]
    data["architectures"] = {name: archs[name] for name in known + sorted(set(archs) - set(known)) if name in archs}
    for row in data["architectures"].values():
        row["paths"] = {p: row["paths"][p] for p in PATHS if p in row["paths"]}
    return data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    data = load_json(args.json)
    if not args.render_only:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvb-matrix-"))
        command = "python -m kvbridge.models.matrix " + " ".join(argv)
        data["runs"] = [r for r in data["runs"] if r["command"] != command][-11:] + [
            {"command": command, "date": stamp, "size": args.size}]
        if args.path_list:
            data["size"] = args.size
        try:
            for arch in args.arch_list:
                run_arch(data, arch, args, workdir, stamp)
                write(data, args, quiet=True)   # after each architecture: a long run stopped keeps what it measured
        finally:
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    write(data, args)
    return 0


def write(data: dict, args, quiet: bool = False) -> None:
    ordered(data)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    page = render_markdown(data)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        kept = kept_part(args.out.read_text()) if args.out.is_file() else ""
        args.out.write_text(page + kept)
    elif not args.json and not quiet:
        print(page)


if __name__ == "__main__":
    raise SystemExit(main())
