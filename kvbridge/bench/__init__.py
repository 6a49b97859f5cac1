"""Benchmarks and demo scenarios: the scenario registry, the runner, the summaries and the store bench."""
