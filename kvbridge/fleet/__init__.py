"""A fleet: several `serve` workers on one host behind vllm-router, sharing one cache server.

`Fleet` starts the cache server, the workers (each with its KV-event publisher for kv_aware) and the
router, in that order, and stops them in the reverse order; `python -m kvbridge fleet` runs one.
"""
from kvbridge.fleet.fleet import Fleet, Worker

__all__ = ["Fleet", "Worker"]
