"""L3's connection to Redis/Valkey: one client, every call bounded, and a breaker that skips a server that is down.

Place in the flow: RedisTier.get/put/lookup -> **RedisLink._call(fn)** -> redis-py -> the server.
The value format and the tier's index live in kvbridge.store.redis_tier; this module only reaches
the server and decides what a fault means.

Faults. Every call is bounded by KVB_L3_TIMEOUT. A connection fault (refused, timed out, reset, a
wrong password, a cluster without a master for a slot) marks L3 down: calls are then skipped at
once (a counted miss or skipped write) while a background prober pings at retry times that back
off from 1 s to 30 s; requests use L3 again once a ping is answered, so a silent server costs one
request one timeout in all. A write the server refuses (OOM: maxmemory without
eviction) is a counted skipped write and leaves L3 up. Nothing here raises to the user: calls
raise StoreFault subclasses (L3Unavailable, L3Refused), which the tier turns into misses.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (AuthenticationError, ClusterDownError, NoPermissionError, OutOfMemoryError,
                              RedisClusterException, RedisError, ResponseError, TryAgainError)
from redis.retry import Retry

from kvbridge.store.breaker import Breaker
from kvbridge.store.objects import StoreFault

log = logging.getLogger("kvbridge.store.redis_tier")   # the L3 tier's one logger, as before it was split

READ_SIZE = 4 << 20              # bytes per socket read (redis-py's default is 64 KiB)


class L3Unavailable(StoreFault):
    """L3 could not be reached (or is marked down and not yet due for a retry)."""


class L3Refused(StoreFault):
    """The server answered with an error (a write refused under maxmemory, a wrong type)."""


def redact(url: str) -> str:
    """The URL without any user or password part, for logs and the GUI."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def connect(url: str, password: str | None, timeout: float) -> redis.Redis | RedisCluster:
    """A redis-py client for KVB_L3_URL with every call bounded by `timeout` and no retries of its own."""
    scheme, _, rest = url.partition("://")
    # socket_read_size: a restore reads MBs per value; redis-py's 64 KiB reads cost a third more than 4 MiB
    # reads of the same bytes (Docs/Research.md §15)
    common = dict(password=password or None, socket_timeout=timeout, socket_connect_timeout=timeout,
                  retry=Retry(NoBackoff(), 0), health_check_interval=0, socket_read_size=READ_SIZE)
    if scheme == "redis-cluster":
        hosts = rest.split("/", 1)[0].rpartition("@")[2].split(",")
        nodes = [ClusterNode(host.rpartition(":")[0], int(host.rpartition(":")[2])) for host in hosts]
        # Connects now (reads the slot map): the caller does this under the breaker.
        return RedisCluster(startup_nodes=nodes, require_full_coverage=False, **common)
    if scheme in ("valkey", "valkeys"):       # the same protocol; redis-py knows only its own schemes
        url = ("rediss" if scheme == "valkeys" else "redis") + "://" + rest
    return redis.Redis.from_url(url, max_connections=32, **common)


class RedisLink:
    """The connection half of RedisTier (a mixin): the client, the breaker, its prober and the fault counters.

    The tier calls _init_link() from its constructor; `name` (the tier's) names the prober thread.
    """

    name: str

    def _init_link(self, url: str, password: str | None, timeout: float, password_env: str,
                   client_factory: Callable[[], Any] | None) -> None:
        self.url = url
        self.timeout = float(timeout)
        self.cluster = url.startswith("redis-cluster://")
        self._password = password
        self._password_env = password_env
        self._factory = client_factory or (lambda: connect(url, password, self.timeout))
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._prober: threading.Thread | None = None
        self._wake = threading.Event()     # set at close: the prober stops
        self._closed = False
        self._breaker = Breaker("L3")
        self.counts: Counter[str] = Counter()   # skipped_down, timeouts, connection_errors, auth_errors, writes_refused
        self._sent_here = threading.local()      # calls sent by each thread (calls_on_this_thread)

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """fn(client) under the breaker: L3Unavailable when down or on a connection fault, L3Refused on a
        server error; a success marks L3 up again."""
        if not self._breaker.allow():
            self.counts["skipped_down"] += 1
            raise L3Unavailable(f"L3 is down ({self._breaker.reason}); next try in {self._breaker.retry_in():.0f} s")
        # one call is one round trip (a pipeline is sent at once; on a cluster, once per node it touches)
        self._sent_here.n = self.calls_on_this_thread() + 1
        try:
            client = self._get_client()
            result = fn(client)
        except AuthenticationError as error:
            self._trip("auth_errors", self._auth_message(error))
            raise L3Unavailable(self._auth_message(error)) from None
        except (ClusterDownError, TryAgainError) as error:     # a master lost, no replica promoted yet
            self._trip("connection_errors", f"cluster: {error}")
            raise L3Unavailable(f"L3 {what}: {error}") from None
        except ResponseError as error:
            text = str(error)
            if isinstance(error, NoPermissionError) or text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                self._trip("auth_errors", self._auth_message(error))
                raise L3Unavailable(self._auth_message(error)) from None
            self._breaker.succeeded()       # it answered: reachable
            if isinstance(error, OutOfMemoryError) or text.startswith("OOM"):   # maxmemory without eviction
                self.counts["writes_refused"] += 1
            else:
                self.counts["server_errors"] += 1
            raise L3Refused(f"L3 {what}: {text}") from None
        except (redis.TimeoutError, TimeoutError) as error:
            self._trip("timeouts", f"{what} took over {self.timeout:g} s (KVB_L3_TIMEOUT)")
            raise L3Unavailable(f"L3 {what} timed out: {error}") from None
        except (redis.ConnectionError, RedisClusterException, OSError, RedisError) as error:
            self._trip("connection_errors", f"{type(error).__name__}: {error}")
            raise L3Unavailable(f"L3 {what} failed: {error}") from None
        self._breaker.succeeded()
        return result

    def calls_on_this_thread(self) -> int:
        """Calls this thread sent to the server (skipped ones not counted): the tier's round trips."""
        return getattr(self._sent_here, "n", 0)

    def _auth_message(self, error: Exception) -> str:
        where = (f"the password in ${self._password_env} (KVB_L3_PASSWORD_ENV)" if self._password_env
                 else "no password (set KVB_L3_PASSWORD_ENV to the NAME of the variable holding it)")
        return f"L3 refused the login with {where}: {str(error)[:120]}"

    def _trip(self, counter: str, reason: str) -> None:
        self.counts[counter] += 1
        self._breaker.failed(reason)
        if self.cluster:    # a fresh client reads the slot map again (after a failover, another master)
            self._drop_client()
        with self._client_lock:
            if self._prober is None and not self._closed:
                self._prober = threading.Thread(target=self._probe_until_up, name=f"kvbridge-{self.name}-probe",
                                                daemon=True)
                self._prober.start()

    def _probe_until_up(self) -> None:
        """Ping at each retry time until the server answers (then requests use it again) or the tier closes.

        It lets go only under the lock _trip starts probers with, and only while the breaker is up: a
        fault that trips it between this loop seeing it up and letting go (when _trip still saw a prober
        and started none) is probed here, not left down with nobody probing (L3 skipped for good)."""
        try:
            while True:
                self._probe_while_down()
                with self._client_lock:
                    if self._closed or not self._breaker.is_down:
                        self._prober = None
                        return
        except BaseException:
            with self._client_lock:
                self._prober = None   # a later fault starts another prober
            raise

    def _probe_while_down(self) -> None:
        while not self._closed and self._breaker.is_down:
            if self._wake.wait(self._breaker.retry_in()):
                return      # closed
            try:
                self._get_client().ping()
            except AuthenticationError as error:
                self.counts["auth_errors"] += 1
                self._breaker.failed(self._auth_message(error))
            except ResponseError as error:
                if str(error).startswith(("NOAUTH", "WRONGPASS")):
                    self.counts["auth_errors"] += 1
                    self._breaker.failed(self._auth_message(error))
                else:
                    self._breaker.succeeded()
            except (redis.TimeoutError, TimeoutError, redis.ConnectionError, RedisClusterException, OSError,
                    RedisError) as error:
                self._breaker.failed(f"{type(error).__name__}: {error}")
                if self.cluster:
                    self._drop_client()
            else:
                self._breaker.succeeded()

    def _get_client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def _drop_client(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:   # closing a broken client: nothing to save
                pass

    def available(self) -> bool:
        return not self._breaker.is_down

    def why_down(self) -> str:
        """The breaker's reason while L3 is marked down, with when it is retried; "" while it is up."""
        if not self._breaker.is_down:
            return ""
        return f"{self._breaker.reason or 'unreachable'} (KVB_L3_URL {redact(self.url)}; next try in " \
               f"{self._breaker.retry_in():.0f} s)"

    def _pipeline(self, client: Any) -> Any:
        return client.pipeline(transaction=False)

    def ping(self) -> bool:
        try:
            return bool(self._call("ping", lambda client: client.ping()))
        except StoreFault:
            return False

    def close(self) -> None:
        with self._client_lock:   # _trip starts a prober under this lock: seen started, or not at all
            self._closed = True
            prober = self._prober
        self._wake.set()
        if prober is not None:
            prober.join(timeout=self.timeout + 1)
        self._drop_client()
