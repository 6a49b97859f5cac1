"""The wire format of llama-server's HTTP API as KVBridge reads it: errors, event streams, timings.

Place in the flow: LlamaServerBackend.generate() -> **sse_events() -> fill_report()** -> the
engine's record (engine_cached_tokens = `timings.cache_n`, checked after every restore).
"""
from __future__ import annotations

import json
from typing import Iterator

import requests

from kvbridge.errors import EngineUnavailable, KVBridgeError
from kvbridge.backends.base import EngineReport


class LlamaServerError(KVBridgeError):
    """llama-server answered with an error status; the message carries its own error text."""

    def __init__(self, path: str, resp: requests.Response | None, detail: str = ""):
        status = ""
        if resp is not None:
            status = f" ({resp.status_code})"
            try:
                body = resp.json()
            except ValueError:
                body = None
            error = body.get("error") if isinstance(body, dict) else None
            detail = (error.get("message") if isinstance(error, dict) else error) or resp.text
        super().__init__(f"llama-server {path} failed{status}: {str(detail)[:300]}")


def sse_events(resp: requests.Response) -> Iterator[dict]:
    """The JSON objects of a llama-server event stream (`data: {...}`; `error: {...}` raises)."""
    lines = resp.iter_lines()
    while True:
        try:
            raw = next(lines, None)
        except requests.RequestException as exc:  # the server died or hung mid-stream
            raise EngineUnavailable(f"llama-server stopped answering during /completion: {exc}") from exc
        if raw is None:
            return
        field, _, payload = raw.decode("utf-8", errors="replace").partition(":")
        payload = payload.strip()
        if field == "data" and payload and payload != "[DONE]":
            try:
                yield json.loads(payload)
            except ValueError:
                raise LlamaServerError("/completion", None, f"unreadable event {payload[:100]!r}") from None
        elif field == "error":
            raise LlamaServerError("/completion", None, payload[:300])


def fill_report(report: EngineReport, final: dict, n_prompt: int) -> None:
    """The stream's last event -> what the engine says it reused (`cache_n`) and computed (`prompt_n`)."""
    timings = final.get("timings") or {}
    if "cache_n" in timings:
        report.engine_cached_tokens = int(timings["cache_n"])
    if "prompt_n" in timings:
        report.engine_prefill_tokens = int(timings["prompt_n"])
    report.prompt_tokens = n_prompt
    if "predicted_n" in timings:
        report.completion_tokens = int(timings["predicted_n"])
    if "prompt_ms" in timings:
        report.prefill_ms = float(timings["prompt_ms"])   # the server's own; the first token is the caller's rest


def slot_timing(result: dict, key: str) -> float | None:
    """llama-server's own duration of a slot action (`timings.save_ms` / `timings.restore_ms`)."""
    value = (result.get("timings") or {}).get(key)
    return float(value) if value is not None else None
