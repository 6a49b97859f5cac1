"""Many conversations on one llama.cpp context (issue 12): `Scheduler(settings)` and its errors.

    from kvbridge.scheduler import Scheduler
    with Scheduler(settings) as scheduler:
        future = scheduler.submit([{"role": "user", "content": "Hi"}], priority=7, n_predict=32)
        print(future.result().text)

Modules, in reading order:
- scheduler: the API (submit, cancel, snapshot, events, drain, close) and the loop that runs the parts;
- intake: a submit's refusals, tokens and checks;
- requests: per-request state and the three queues;
- policy: who runs, who waits, who is preempted (pressure, admission, priorities);
- planner: one step's batch;
- lifecycle: start, preempt, finish, cancel, fail, and faults kept to the requests they touch;
- streaming: what a decode gives: sampling, streaming, stop checks;
- prefix_cache: sharing resident cells and keeping finished prompts resident;
- restorer: restore from the store, store prompts and swapped-out sequences, recompute after a
  refused restore;
- blend_placement: blend requests' passages placed and stored;
- events: the event log, the counters and the snapshot;
- kv_listeners: who is told which unsalted chunks are resident and stored (a KV-event publisher);
- sequences and ledger: llama.cpp's sequence ids and the KV budget in blocks, shared extents, pressure;
- sequence_store and salts: each cache salt's sequences in the store, and the bounded table of them.
The low-level llama.cpp calls and the sampler are kvbridge.backends.llama_context, which blend mode
uses too.
"""
from kvbridge.scheduler.intake import QueueFull, RequestRefused
from kvbridge.scheduler.scheduler import Scheduler

__all__ = ["QueueFull", "RequestRefused", "Scheduler"]
