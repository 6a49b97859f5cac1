"""The S3 tier's connection: one boto3 client with explicit keys, every call bounded, and a breaker.

Place in the flow: S3Tier.get/put/lookup -> **S3Link._call(fn)** -> boto3 -> the endpoint. The object
layout and the index live in kvbridge.store.s3_tier; this module only reaches the endpoint and decides
what a fault means.

Credentials. Only the two variables KVB_S3_ACCESS_KEY_ENV / KVB_S3_SECRET_KEY_ENV name are read, and the
keys go to boto3 explicitly: boto3's default credential chain (~/.aws, instance metadata, which hangs for
seconds offline) is never consulted. The keys are never logged; messages name the settings, not values.

Faults. Every call is bounded by KVB_S3_TIMEOUT (connect and read) with no retries of boto3's own. A
connection fault or timeout, and a refused signature, mark S3 down: calls are then skipped at once (a
counted miss or skipped write) while a background prober sends one cheap request (HEAD of the bucket)
at retry times that back off from 1 s to 30 s; so a silent endpoint costs one request one timeout in
all. Another error the endpoint answers with (a 5xx, a SlowDown) is an S3Refused fault and leaves S3 up.
Nothing here raises to the user: calls raise StoreFault subclasses, which the tier turns into misses.

The breaker is L3's rule, from the one module of every remote tier (kvbridge.store.breaker).
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable

from kvbridge.store.breaker import Breaker
from kvbridge.store.objects import StoreFault

log = logging.getLogger("kvbridge.store.s3_tier")

POOL_CONNECTIONS = 32            # parallel GETs of one restore share these
AUTH_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                        "ExpiredToken", "AuthorizationHeaderMalformed", "InvalidSecurity"})
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class S3Unavailable(StoreFault):
    """S3 could not be reached, refused our keys, or is marked down and not yet due for a retry."""


class S3Refused(StoreFault):
    """The endpoint answered with an error (a 5xx, SlowDown, a missing bucket)."""


class S3Missing(StoreFault):
    """No object under that name (deleted by another host's eviction, or never written)."""


def connect(url: str, region: str, access_key: str, secret_key: str, timeout: float) -> Any:
    """A boto3 S3 client for KVB_S3_URL with the keys given explicitly and every call bounded by `timeout`."""
    import boto3                              # loaded only when the S3 tier is used (the s3 extra)
    from botocore.config import Config

    config = Config(connect_timeout=timeout, read_timeout=timeout, retries={"total_max_attempts": 1},
                    max_pool_connections=POOL_CONNECTIONS, s3={"addressing_style": "path"},
                    signature_version="s3v4", tcp_keepalive=True)
    session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                                    region_name=region)
    return session.client("s3", endpoint_url=url, config=config)


class S3Link:
    """The connection half of S3Tier (a mixin): the client, the breaker, its prober and the fault counters."""

    name: str
    bucket: str

    def _init_link(self, url: str, region: str, access_key: str, secret_key: str, timeout: float,
                   key_envs: tuple[str, str]) -> None:
        self.url = url
        self.region = region
        self.timeout = float(timeout)
        self._key_envs = key_envs
        self._client = connect(url, region, access_key, secret_key, self.timeout)
        self._lock_link = threading.Lock()
        self._prober: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False
        self._breaker = Breaker(f"S3 tier {self.name}")
        self.counts: Counter[str] = Counter()   # skipped_down, timeouts, connection_errors, auth_errors, server_errors
        self._sent_here = threading.local()

    def _call(self, what: str, fn: Callable[[Any], Any], *, count: bool = True) -> Any:
        """fn(client) under the breaker. S3Unavailable when down, on a connection fault, a timeout or refused
        keys; S3Missing for a missing object; S3Refused for another error the endpoint answered with."""
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError)

        if self._breaker.is_down:
            self.counts["skipped_down"] += 1
            raise S3Unavailable(f"S3 is down ({self._breaker.reason}); next try in {self._breaker.retry_in():.0f} s")
        if count:   # one call is one round trip (the parallel GETs of a get_many count once, by their caller)
            self._sent_here.n = self.calls_on_this_thread() + 1
        try:
            result = fn(self._client)
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in MISSING_CODES or (status == 404 and code != "NoSuchBucket"):
                self._breaker.succeeded()
                raise S3Missing(f"S3 {what}: no such object") from None
            if code in AUTH_CODES or status in (401, 403):
                message = self.auth_message(code or str(status))
                self._trip("auth_errors", message)
                raise S3Unavailable(message) from None
            self._breaker.succeeded()          # it answered: reachable
            self.counts["server_errors"] += 1
            if code == "NoSuchBucket":
                raise S3Refused(f"S3 {what}: bucket {self.bucket!r} (KVB_S3_BUCKET) does not exist") from None
            raise S3Refused(f"S3 {what}: {code} {str(error)[:160]}") from None
        except (ReadTimeoutError, ConnectTimeoutError, TimeoutError) as error:
            self._trip("timeouts", f"{what} took over {self.timeout:g} s (KVB_S3_TIMEOUT)")
            raise S3Unavailable(f"S3 {what} timed out: {error}") from None
        except (BotoCoreError, OSError) as error:
            self._trip("connection_errors", f"{type(error).__name__}: {str(error)[:160]}")
            raise S3Unavailable(f"S3 {what} failed: {error}") from None
        self._breaker.succeeded()
        return result

    def auth_message(self, code: str) -> str:
        """Refused keys, naming the settings that name the variables (never a key's value)."""
        access_env, secret_env = self._key_envs
        return (f"S3 at {self.url} refused the keys ({code}): check the access key in ${access_env} "
                f"(KVB_S3_ACCESS_KEY_ENV) and the secret key in ${secret_env} (KVB_S3_SECRET_KEY_ENV), "
                f"and that they may use bucket {self.bucket!r} (KVB_S3_BUCKET)")

    def calls_on_this_thread(self) -> int:
        return getattr(self._sent_here, "n", 0)

    def _trip(self, counter: str, reason: str) -> None:
        self.counts[counter] += 1
        self._breaker.failed(reason)
        with self._lock_link:
            if self._prober is None and not self._closed:
                self._prober = threading.Thread(target=self._probe_until_up, name=f"kvbridge-{self.name}-probe",
                                                daemon=True)
                self._prober.start()

    def _probe_until_up(self) -> None:
        """HEAD the bucket at each retry time until it answers (then requests use S3 again) or the tier closes;
        lets go under the lock _trip starts probers with, so a fault meanwhile is never left unprobed."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            while True:
                while not self._closed and self._breaker.is_down:
                    if self._wake.wait(self._breaker.retry_in()):
                        return
                    try:
                        self._client.head_bucket(Bucket=self.bucket)
                    except ClientError as error:
                        code = str(error.response.get("Error", {}).get("Code", ""))
                        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                        if code in AUTH_CODES or status in (401, 403):
                            self.counts["auth_errors"] += 1
                            self._breaker.failed(self.auth_message(code or str(status)))
                        else:
                            self._breaker.succeeded()   # it answered (a missing bucket is the tier's to say)
                    except (BotoCoreError, OSError) as error:
                        self._breaker.failed(f"{type(error).__name__}: {str(error)[:160]}")
                    else:
                        self._breaker.succeeded()
                with self._lock_link:
                    if self._closed or not self._breaker.is_down:
                        self._prober = None
                        return
        finally:
            with self._lock_link:
                if self._prober is threading.current_thread():
                    self._prober = None

    def available(self) -> bool:
        return not self._breaker.is_down

    def why_down(self) -> str:
        if not self._breaker.is_down:
            return ""
        return f"{self._breaker.reason or 'unreachable'} (KVB_S3_URL {self.url}; next try in " \
               f"{self._breaker.retry_in():.0f} s)"

    def close_link(self) -> None:
        with self._lock_link:
            self._closed = True
            prober = self._prober
        self._wake.set()
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout=self.timeout + 1)
