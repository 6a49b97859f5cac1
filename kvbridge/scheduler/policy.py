"""Who runs, who waits and who is preempted: pressure, admission in priority order, and the choice of
the request to preempt.

Each step, before its batch is planned:
  - pressure from free blocks (kvbridge.scheduler.ledger): SOFT evicts cold cached prefixes (least
    recently used first), CRITICAL preempts the lowest-priority running request;
  - swapped requests resume first (restored from the store), then waiting ones are admitted in
    priority order while the budget allows and pressure is below HARD; a waiting request more
    urgent than the least urgent running one preempts it when the budget or the slots are short;
    one whose prompt a running request is still prefilling waits for it, to share it (a system
    prompt that many users send at once is prefilled once).
The moves themselves (start, preempt, fail) are the Lifecycle's; the policy only decides.
"""
from __future__ import annotations

import time

from kvbridge.errors import KVBridgeError
from kvbridge.scheduler.intake import RequestRefused
from kvbridge.scheduler.ledger import Pressure
from kvbridge.scheduler.lifecycle import Lifecycle
from kvbridge.scheduler.prefix_cache import PrefixCache
from kvbridge.scheduler.requests import Queues, Request
from kvbridge.scheduler.sequences import SequencePool


class Policy:
    def __init__(self, queues: Queues, pool: SequencePool, cache: PrefixCache, lifecycle: Lifecycle,
                 max_running: int) -> None:
        self.queues = queues
        self.pool = pool
        self.ledger = pool.ledger
        self.cache = cache
        self.lifecycle = lifecycle
        self.max_running = max_running

    def relieve_pressure(self) -> None:
        while self.ledger.pressure() >= Pressure.SOFT and self.cache.prefixes:
            self.cache.evict_coldest()
        if self.ledger.pressure() >= Pressure.CRITICAL and len(self.queues.running) > 1:
            self.lifecycle.preempt(self.least_urgent(), "critical pressure")

    def resume_swapped(self) -> None:
        swapped = self.queues.swapped
        for request in sorted(swapped, key=lambda r: (-r.priority, r.submitted)):
            if not self.make_room(request):
                break
            swapped.remove(request)
            self.lifecycle.start(request, resumed=True)

    def admit_waiting(self) -> None:
        waiting = self.queues.waiting
        top_swapped = max((r.priority for r in self.queues.swapped), default=-1)
        for request in sorted(waiting, key=lambda r: (-r.priority, r.submitted)):
            if request.priority <= top_swapped:
                break        # swapped requests resume before new ones of no higher priority
            if self.ledger.pressure() >= Pressure.HARD and not self.can_preempt_for(request):
                break
            if self.cache.in_prefill(request):
                continue     # share it when its prefill is done rather than prefill the same tokens twice
            if not self.make_room(request):
                if self.can_preempt_for(request):
                    self.lifecycle.preempt(self.least_urgent(), f"for {request.holder} (priority {request.priority})")
                    if not self.room_for(request):
                        break
                else:
                    break
            waiting.remove(request)
            request.admitted_at = time.perf_counter()
            request.record.queue_ms = (request.admitted_at - request.submitted) * 1e3
            self.lifecycle.start(request, resumed=False)

    def make_room(self, request: Request) -> bool:
        """Whether the request fits, after evicting cold cached prefixes (least recently used first)
        when blocks are short; a full set of running slots is not helped by evicting anything."""
        if len(self.queues.running) >= self.max_running:
            return False
        while not self.room_for(request) and self.cache.prefixes:
            self.cache.evict_coldest()
        return self.room_for(request)

    def room_for(self, request: Request) -> bool:
        """A free slot and blocks for the context (a shared prefix costs nothing) plus a decode block each."""
        running = self.queues.running
        if len(running) >= self.max_running or not self.pool.free:
            return False
        _, shared = self.cache.best_source(request.context, request.salt)
        cost = self.ledger.blocks_for(len(request.context) - shared) + len(running) + 1
        if not running:   # alone it may use the whole budget: never wait for nobody
            return cost <= self.ledger.free_blocks()
        return self.ledger.pressure(extra_blocks=cost) < Pressure.HARD and cost <= self.ledger.free_blocks()

    def can_preempt_for(self, request: Request) -> bool:
        return bool(self.queues.running) and self.least_urgent().priority < request.priority

    def least_urgent(self) -> Request:
        return min(self.queues.running, key=lambda r: (r.priority, -r.submitted))

    def no_room(self, rc: int) -> None:
        """llama.cpp found no cells for the batch: preempt or evict, then the next step retries."""
        if rc < 0:
            raise KVBridgeError(f"llama_decode failed with {rc}")
        if self.cache.prefixes:
            self.cache.evict_coldest()
        elif len(self.queues.running) > 1:
            self.lifecycle.preempt(self.least_urgent(), "llama.cpp had no free cells")
        else:
            request = self.queues.running[0]
            self.queues.running.remove(request)
            self.pool.free_holder(request)
            self.lifecycle.fail(request, RequestRefused("the KV cache has no room for this request (KVB_SCHED_KV_CELLS)"))
