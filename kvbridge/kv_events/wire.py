"""The wire format of KV events, as vLLM publishes them and vllm-router's `kv_aware` policy, Dynamo and
llm-d read them: one module, so the format is read in one place.

A message is three ZMQ frames: topic (b""), an 8-byte big-endian sequence number (from 0, no gaps),
and a msgpack batch `[timestamp, [event, ...], data_parallel_rank]`. Each event is a msgpack map with
a "type" key (vllm-router 0.1.17 decodes an internally tagged enum; a positional array would put the
fields in the wrong slots). Block hashes are unsigned 64-bit ints: the first 8 bytes of KVBridge's
chunk hash. The router hashes `token_ids` itself and compares them with the worker's own tokens, so
the hash only names a block (for its children's `parent_block_hash` and for removals).
"""
from __future__ import annotations

import time

import msgspec

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)   # ends a replay answer (vLLM's sentinel)
MEDIA = ("GPU", "CPU", "DISK")   # resident in the context (full weight), store L1, store L2/L3


class BlockStored(msgspec.Struct, tag=True, tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type"):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type"):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(tuple[float, list[Event], int | None])


def block_id(chunk_hash: bytes) -> int:
    """A chunk hash as the unsigned 64-bit block hash events carry."""
    return int.from_bytes(chunk_hash[:SEQ_BYTES], "big")


def encode_batch(events: list, timestamp: float | None = None) -> bytes:
    """`[ts, [events], None]`: vLLM's EventBatch (array_like) with no data-parallel rank."""
    return _encoder.encode((time.time() if timestamp is None else timestamp, events, None))


def decode_batch(payload: bytes) -> tuple[float, list, int | None]:
    """The inverse, for tests and consumers written in Python."""
    return _batch_decoder.decode(payload)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def read_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
