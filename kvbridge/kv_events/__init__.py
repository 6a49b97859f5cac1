"""KV events (issue 34): what this instance holds, published in vLLM's format so that vllm-router's
`kv_aware` policy (and Dynamo, llm-d) can send each request where its prefix already is.

    from kvbridge.kv_events import start_kv_events
    events = start_kv_events(settings, scheduler, instance_id)   # None unless KVB_KV_EVENTS_URL is set
    print(events.endpoint)          # give it to the router: --kv-event-source WORKER_URL=<endpoint>
    events.close()

Its place in the flow: the scheduler reports the token runs resident in its context and the prompts it
stored; `block_view` turns them into blocks (block size = the chunk size, block hash = the chunk hash's
first 8 bytes) with their medium (GPU resident, CPU in L1, DISK in L2/L3) and rechecks the store every
KVB_KV_EVENTS_CHECK_S; `publisher` sends the events on a ZMQ PUB socket with a replay socket beside it;
`wire` is the format.

What events reveal: the token ids of every prompt prefix this instance holds, to anyone who can connect
to the socket. Only unsalted requests are ever reported (the scheduler's listener skips any sequence
with a tenant or a cache_salt, and blend sequences), the socket binds only 127.0.0.1 or an ipc:// path
of mode 0600 (`kvbridge fleet`: in a folder of mode 0700, so no other account reaches it; a TCP socket
cannot be authenticated, vllm-router has no CURVE), and nothing is published unless KVB_KV_EVENTS_URL is set.
"""
from __future__ import annotations

import logging

from kvbridge.kv_events import wire
from kvbridge.kv_events.block_view import BlockView
from kvbridge.kv_events.publisher import REPLAY_BATCHES, KVEventPublisher, KVEventsUrlError, check_events_url

log = logging.getLogger(__name__)


class KVEvents:
    """A running publisher and the view that feeds it: `.endpoint`, `.replay_endpoint`, `.close()`."""

    def __init__(self, publisher: KVEventPublisher, view: BlockView, instance_id: str, block_size: int):
        self.publisher = publisher
        self.view = view
        self.instance_id = instance_id
        self.block_size = block_size
        self.endpoint = publisher.endpoint
        self.replay_endpoint = publisher.replay_endpoint
        self._closed = False

    def kv_event_sources(self) -> dict:
        """The body of GET /kv_event_sources as vllm-router 0.1.17 reads it (checked against the binary): a
        map from data-parallel rank (a string) to the source; it needs schema_version and the vLLM
        KVEventsConfig fields, and subscribes to nothing when one is missing."""
        return {"0": {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": "",
                      "publisher": "zmq", "encoding": "msgpack", "schema_version": 1,
                      "enable_kv_cache_events": True, "hwm": 100_000, "buffer_steps": REPLAY_BATCHES}}

    def server_info_fields(self) -> dict:
        """What GET /get_server_info must carry for the router to index this worker's events: without
        kv_block_size it logs "no block_size from /get_server_info — cannot index"; instance_id names
        the worker in its logs."""
        return {"kv_block_size": self.block_size, "effective_attention_block_size": self.block_size,
                "instance_id": self.instance_id}

    def close(self) -> None:
        """Stop the view, tell subscribers nothing is held any more, close the sockets."""
        if self._closed:
            return
        self._closed = True
        self.view.close()
        self.publisher.close(final_events=[wire.AllBlocksCleared()])

    def __enter__(self) -> "KVEvents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_kv_events(settings, scheduler, instance_id: str) -> KVEvents | None:
    """None when settings.kv_events_url is empty; else bind, listen to the scheduler, and return the handle."""
    url = settings.kv_events_url.strip()
    if not url:
        return None
    publisher = KVEventPublisher(url)
    view = BlockView(scheduler, publisher.publish, chunk_size=settings.chunk_size,
                     check_s=settings.kv_events_check_s)
    publisher.on_subscribe = view.request_resync
    scheduler.add_kv_listener(view)
    log.info("KV events of %s on %s (replay %s), block size %d", instance_id, publisher.endpoint,
             publisher.replay_endpoint, settings.chunk_size)
    return KVEvents(publisher, view, instance_id, settings.chunk_size)


__all__ = ["BlockView", "KVEventPublisher", "KVEvents", "KVEventsUrlError", "check_events_url",
           "start_kv_events", "wire"]
