#!/usr/bin/env python3
"""Benchmark: prompt prefill speed of each llama.cpp build variant, side by side in one run.

For every rung of the ladder in scripts/build_variants.py (claimed, no-amx, avx2, as far as they
differ on this CPU) and for GGML_NATIVE=ON (-march=native, the reference) this builds the
shared libraries (libllama, libggml*) from the vendored llama.cpp of the pinned sdist into
build/variants/<name>/ (git-ignored; rebuilt only when the flags change), then measures prefill
tokens/s of the embedded model with each. llama-cpp-python loads libllama from
$LLAMA_CPP_LIB_PATH when set (llama_cpp/llama_cpp.py), so every measurement is a fresh child
process with that variable pointing at one variant; the child reports which libggml-cpu it
mapped, and a mismatch fails the run. Rounds alternate the variants (the order rotates each
round) so drift of the machine spreads over all of them.

The machine is shared: with other processes on the cores, ggml's threads wait for each other at
every graph node and the wall clock measures the neighbours. So the default is one thread and the
figure that decides is tokens per CPU-second of the prefilling process (its own compute, whoever
else runs); wall-clock tokens/s is reported beside it.

Usage: .venv/bin/python scripts/bench_build_variants.py [--rounds 5] [--tokens 256] [--threads 1] [--variants native,avx2]
Results: a Markdown table on stdout, the raw numbers in build/variants/bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_variants  # noqa: E402  (sibling scripts, not a package)
import smoke_decode  # noqa: E402

REPO_ROOT = build_variants.REPO_ROOT
VARIANTS_DIR = REPO_ROOT / "build" / "variants"
FILLER = ("The quick brown fox jumps over the lazy dog while the cache keeps every chunk it has seen. "
          "Prefill reads the whole prompt once; decode then adds one token at a time. ")


def build_variant(source: Path, variant: build_variants.Variant, jobs: int) -> Path:
    """Configure and build libllama + libggml* for one variant; return the folder holding them."""
    build_dir = VARIANTS_DIR / variant.name
    flags_file = build_dir / "kvbridge-flags.txt"
    lib_dir = build_dir / "bin"
    if flags_file.is_file() and flags_file.read_text() == variant.cmake_args_text and (lib_dir / "libllama.so").is_file():
        print(f"[bench] '{variant.name}' already built with the same flags: {lib_dir}", flush=True)
        return lib_dir
    if flags_file.exists():
        flags_file.unlink()  # flags changed: a reused CMake cache would keep stale options
        subprocess.run(["cmake", "-E", "rm", "-rf", str(build_dir)], check=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    print(f"[bench] building '{variant.name}' ({variant.cmake_args_text})…", flush=True)
    start = time.monotonic()
    log = build_dir / "build.log"
    with log.open("w") as out:
        for cmd in (["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                     "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                     *variant.cmake_args],
                    ["cmake", "--build", str(build_dir), "--target", "llama", "-j", str(jobs)]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                sys.exit(f"[bench] building '{variant.name}' failed; see {log}")
    flags_file.write_text(variant.cmake_args_text)
    print(f"[bench] '{variant.name}' built in {time.monotonic() - start:.0f} s", flush=True)
    return lib_dir


def measure_child(model: Path, n_tokens: int, repeats: int, threads: int) -> None:
    """In a child with LLAMA_CPP_LIB_PATH set: prefill n_tokens, `repeats` times after a warm-up."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=n_tokens + 64, n_batch=n_tokens, n_ubatch=n_tokens,
                          n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
    tokens = llm.tokenize((FILLER * (n_tokens // 20 + 1)).encode())[:n_tokens]
    cpu_rates, wall_rates = [], []
    for attempt in range(repeats + 1):
        llm.reset()
        wall, cpu = time.perf_counter(), time.process_time()
        llm.eval(tokens)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if attempt:  # the first is a warm-up (page faults, thread pool start)
            cpu_rates.append(len(tokens) / cpu)
            wall_rates.append(len(tokens) / wall)
    print(json.dumps({"cpu_tokens_per_s": cpu_rates, "wall_tokens_per_s": wall_rates,
                      "libggml_cpu": smoke_decode.loaded_library("libggml-cpu")}))


def measure(lib_dir: Path, model: Path, n_tokens: int, repeats: int, threads: int) -> dict:
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib_dir)}
    done = subprocess.run([sys.executable, __file__, "--child", "--model", str(model), "--tokens", str(n_tokens),
                           "--repeats", str(repeats), "--threads", str(threads)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"[bench] measuring {lib_dir} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["libggml_cpu"].startswith(str(lib_dir)):
        sys.exit(f"[bench] the child loaded {result['libggml_cpu']!r}, not the variant in {lib_dir}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256, help="prompt tokens per prefill")
    parser.add_argument("--repeats", type=int, default=3, help="prefills per child process (after a warm-up)")
    parser.add_argument("--variants", default="", help="comma-separated subset of the ladder")
    parser.add_argument("--model", type=Path, default=build_variants.DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1, help="ggml threads per prefill (see above)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure_child(args.model, args.tokens, args.repeats, args.threads)
        return 0

    ladder = build_variants.build_ladder(build_variants.cpu_flags(), platform.machine())
    candidates = ladder + [build_variants.NATIVE] * (build_variants.NATIVE not in ladder)
    wanted = [name for name in args.variants.split(",") if name]
    variants = [v for v in candidates if not wanted or v.name in wanted]
    version = build_variants.pinned_version(REPO_ROOT / "requirements.txt")
    source = build_variants.fetch_source(sys.executable, version, REPO_ROOT / "build")
    lib_dirs = {v.name: build_variant(source, v, args.jobs) for v in variants}

    cpu: dict[str, list[float]] = {v.name: [] for v in variants}
    wall: dict[str, list[float]] = {v.name: [] for v in variants}
    for round_index in range(args.rounds):
        order = variants[round_index % len(variants):] + variants[:round_index % len(variants)]
        for variant in order:
            got = measure(lib_dirs[variant.name], args.model, args.tokens, args.repeats, args.threads)
            cpu[variant.name] += got["cpu_tokens_per_s"]
            wall[variant.name] += got["wall_tokens_per_s"]
            print(f"[bench] round {round_index + 1}/{args.rounds} {variant.name:7} "
                  f"{statistics.median(got['cpu_tokens_per_s']):7.1f} tokens/CPU-s "
                  f"{statistics.median(got['wall_tokens_per_s']):7.1f} tokens/s wall", flush=True)

    reference = build_variants.NATIVE if build_variants.NATIVE in variants else variants[0]
    base = statistics.median(cpu[reference.name])
    print(f"\nPrefill of {args.tokens} tokens, {args.rounds} rounds x {args.repeats} prefills per variant, "
          f"{args.threads} thread(s), llama-cpp-python {version}\n")
    print(f"| variant | tokens per CPU-second (median) | min–max | vs {reference.name} | "
          f"wall tokens/s (median) | flags |")
    print("|---|---:|---:|---:|---:|---|")
    for variant in variants:
        r = cpu[variant.name]
        print(f"| {variant.name} | {statistics.median(r):.1f} | {min(r):.0f}–{max(r):.0f} | "
              f"{statistics.median(r) / base:.2f} | {statistics.median(wall[variant.name]):.1f} | "
              f"`{variant.cmake_args_text}` |")
    fastest = max(variants, key=lambda v: statistics.median(cpu[v.name]))
    print(f"\nfastest: {fastest.name}")
    (VARIANTS_DIR / "bench.json").write_text(json.dumps(
        {"tokens": args.tokens, "rounds": args.rounds, "repeats": args.repeats, "threads": args.threads,
         "version": version, "load_average": os.getloadavg(),
         "cpu_model": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                            if line.startswith("model name")), ""),
         "variants": {v.name: {"cmake_args": list(v.cmake_args), "cpu_tokens_per_s": cpu[v.name],
                               "wall_tokens_per_s": wall[v.name]} for v in variants}},
        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
