"""What several benchmarks (and the GUI) share: scenarios, the runner, the report, workloads, private servers."""
