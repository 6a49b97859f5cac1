"""ClientTable: the server's view of who is connected: registered clients (hello) and when each was last heard.

Place in the flow: the server's loop registers a client at its hello and touches it on every request;
the management module's reaper asks it for the stale ones; status and the GUI read `snapshot()`.
"""
from __future__ import annotations

import threading
import time

from kvbridge.cache_server.calls import ClientInfo
from kvbridge.cache_server.liveness import InstanceClock


class ClientTable:
    """Registered clients (hello) and when each was last heard from: the server's view of who is connected.

    A client's hello is its first touch on the clock, so one that has sent nothing since is given
    the registration grace (InstanceClock's rule, the same the storage module applies).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, ClientInfo] = {}
        self._clock = InstanceClock()

    def register(self, info: ClientInfo) -> None:
        with self._lock:
            self._clients[info.instance_id] = info
            self._clock.forget(info.instance_id)
            self._clock.touch(info.instance_id)

    def get(self, instance_id: str) -> ClientInfo | None:
        with self._lock:
            return self._clients.get(instance_id)

    def touch(self, instance_id: str) -> None:
        with self._lock:
            if instance_id in self._clients:
                self._clock.touch(instance_id)

    def remove(self, instance_id: str) -> bool:
        with self._lock:
            self._clock.forget(instance_id)
            return self._clients.pop(instance_id, None) is not None

    def stale(self, timeout_s: float, grace_s: float) -> list[str]:
        return self._clock.stale(timeout_s, grace_s)

    def snapshot(self) -> list[dict]:
        now, clock_now = time.time(), self._clock.now()
        with self._lock:
            rows = []
            for cid, info in self._clients.items():
                _, last, touches = self._clock.seen(cid) or (clock_now, clock_now, 1)
                rows.append({"instance_id": cid, "priority": info.priority, "pid": info.pid, "hostname": info.hostname,
                             "label": info.label, "connected_s": round(now - info.registered_at, 1),
                             "idle_s": round(clock_now - last, 1), "requests": touches - 1})
            return rows

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)
