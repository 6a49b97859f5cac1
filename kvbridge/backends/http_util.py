"""Small HTTP helpers the REST-speaking shadow backends (Ollama, cloud) share."""
from __future__ import annotations

import json
from typing import Any, Iterable, Iterator, Mapping

import requests
from urllib3.exceptions import ReadTimeoutError

MAX_DETAIL_CHARS = 300


def is_read_timeout(err: requests.RequestException) -> bool:
    """requests reports a read timeout inside a streamed body as a ConnectionError wrapping urllib3's."""
    return isinstance(err, requests.Timeout) or any(isinstance(a, ReadTimeoutError) for a in err.args)


def error_message(error: Any) -> str:
    """The readable part of an error object: {"message": ...} (OpenAI), a plain string (Ollama)."""
    if isinstance(error, Mapping):
        return str(error.get("message") or error.get("type") or error)[:MAX_DETAIL_CHARS]
    return str(error)[:MAX_DETAIL_CHARS]


def error_text(response: requests.Response) -> str:
    """What an error response says, short enough for one line of a record."""
    try:
        body = response.json()
    except ValueError:
        return (response.text or response.reason or "")[:MAX_DETAIL_CHARS].strip()
    if isinstance(body, Mapping) and body.get("error"):
        return error_message(body["error"])
    return str(body)[:MAX_DETAIL_CHARS]


def json_objects(texts: Iterable[str | bytes]) -> Iterator[dict | None]:
    """Each non-blank text of a stream parsed as a JSON object; None for one that is not (the caller counts it)."""
    for text in texts:
        if not text.strip():
            continue
        try:
            event = json.loads(text)
        except ValueError:
            yield None
            continue
        yield event if isinstance(event, dict) else None
