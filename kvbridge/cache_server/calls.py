"""What a core-request handler receives and returns: the contract between the server's router and modules.

A module registers a handler for a core request kind in its `register_handlers(router)` hook:

    def register_handlers(self, router):
        router.handle(Kind.LOOKUP, self.lookup, owner=self.module_name)

    def lookup(self, call: Call) -> Answer:
        hits = self.context.store.lookup(call.body.hashes, call.body.namespace)
        return Answer(LookupReply(hits.n_hit, hits.tiers))

`call.body` is the typed request body (kvbridge.cache_server.protocol), `call.data` the inline data
frames. A handler returns an Answer (a reply body and optional data frames) or raises RequestFailed
with a code and a message for a person; any other exception is a bug: the server logs it, counts it
and replies with an internal error, and keeps serving. A handler registered later for the same kind
replaces the earlier one (modules register in construction order), so a module that depends on
another can wrap or override its handler: keep the old one from `router.core(kind)` first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ClientInfo:
    """What a client said about itself at hello. pid and hostname are its claim, shown in status and
    logs only: nothing is decided on them (a write's quarantine follows the writer lock, liveness.py)."""

    instance_id: str
    priority: int
    pid: int
    hostname: str
    label: str
    registered_at: float   # time.time()
    connection: bytes = b""   # the ROUTER identity of the connection that said hello: the only one it answers


@dataclass
class Call:
    """One request as a handler sees it."""

    instance_id: str
    kind: str
    body: Any
    client: ClientInfo | None
    data: list = field(default_factory=list)   # inline data frames (memoryview-able)


@dataclass
class Answer:
    """A handler's result: the reply body (a msgspec Struct, or a plain msgpack value) and data frames."""

    body: Any = None
    data: tuple = ()


class RequestFailed(Exception):
    """A request the server refuses: its code (protocol.Code) and a message for a person."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
