"""Many conversations on one llama.cpp context (issue 12): `Scheduler(settings)` and its errors.

    from kvbridge.scheduler import Scheduler
    with Scheduler(settings) as scheduler:
        future = scheduler.submit([{"role": "user", "content": "Hi"}], priority=7, n_predict=32)
        print(future.result().text)

Modules, in reading order: ledger (the KV budget in blocks, shared extents, pressure), requests
(per-request state), swap (the store as swap space), scheduler (the loop). The low-level llama.cpp
calls and the sampler are kvbridge.backends.llama_context, which blend mode uses too.
"""
from kvbridge.scheduler.scheduler import QueueFull, RequestRefused, Scheduler

__all__ = ["QueueFull", "RequestRefused", "Scheduler"]
