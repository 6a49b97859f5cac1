"""Benchmarks: what a user runs, the helpers they share, and research probes kept apart.

- the benchmark commands (`kvbridge bench`, `bench-store`, `bench-restore`, `bench-cache-server`,
  `bench-l3`, `bench-floor`, `bench-scheduler`, `bench-serve`) are listed in registry.py with what
  each measures and its baseline; their measurements are the modules beside it (store_bench,
  cache_server_bench, l3_bench with l3_wire and codec_bench, floor_bench, long_context and rag (two
  scenarios of `bench`), scheduler_compare with scheduler_bench and scheduler_report, serve_bench);
- common/: what several benchmarks and the GUI share (the scenario registry, the runner, the report
  tables, the lab's workloads, private cache and Redis servers started for a run);
- probes/: one-off research measurements and robustness runs (`python -m kvbridge.bench.probes.<name>`)
  whose figures went to Docs/Research.md; no command runs them.
"""
