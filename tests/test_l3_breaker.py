"""The L3 breaker comes back up after any interleaving of its prober and a new fault.

The race from the review: the prober's loop sees L3 up and is about to let go when a request's fault
trips the breaker; _trip still sees a prober and starts none, the prober then exits, and L3 stays
down with nobody probing: every later request skips it for good. The breaker below trips a fault at
exactly that moment, on a real Redis.
"""
from __future__ import annotations

import threading
import time

from kvbridge.store.breaker import Breaker as _Breaker
from kvbridge.store.redis_tier import RedisTier
from tests.redis_helpers import RedisServer, needs_redis


@needs_redis
def test_a_fault_as_the_prober_lets_go_is_still_probed_until_l3_is_up():
    with RedisServer() as server:
        tier = RedisTier(server.url, timeout=1.0)

        class FaultAtTheWrongMoment(_Breaker):
            armed = True

            @property
            def is_down(self) -> bool:
                down = super().is_down
                if not down and self.armed and threading.current_thread().name.endswith("-probe"):
                    self.armed = False
                    tier._trip("timeouts", "a request timed out just as the prober saw L3 up")
                return down

        tier._breaker = FaultAtTheWrongMoment()
        try:
            tier._trip("timeouts", "the first fault")
            assert not tier.available()
            deadline = time.monotonic() + 10
            while not (tier.available() and not tier._breaker.armed):
                assert time.monotonic() < deadline, "L3 stayed down with nobody probing it"
                time.sleep(0.05)
            assert tier.get(b"k" * 16) is None        # and it is used again
        finally:
            tier.close()
