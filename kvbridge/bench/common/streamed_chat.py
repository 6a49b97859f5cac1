"""One streamed, greedy chat request through the official openai SDK, timed the way a user feels it:
what bench-serve and bench-fleet both send and read (their own answers keep what each reports).

TTFT is the client's: from sending the request to the first chunk that carries content; the usage
comes from the stream's last chunk (`stream_options.include_usage`); an SDK error, a stream without
usage or without content is the answer's `error`, never an exception.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StreamedChat:
    headers: dict[str, str] = field(default_factory=dict)   # the response's, lower-cased names
    text: str = ""
    ttft_ms: float | None = None          # request sent -> first chunk with content
    last_token_ms: float | None = None    # request sent -> last chunk with content
    total_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None      # usage.prompt_tokens_details.cached_tokens; None: not reported
    error: str = ""


def stream_chat(client, model: str, messages: list[dict], max_tokens: int, extra_body: dict | None = None) -> StreamedChat:
    import openai

    out, pieces, usage = StreamedChat(), [], None
    sent = time.perf_counter()
    try:
        with client.chat.completions.with_streaming_response.create(
                model=model, messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body=extra_body) as response:
            out.headers = {name.lower(): value for name, value in response.headers.items()}
            for chunk in response.parse():
                for choice in chunk.choices:
                    if choice.delta is not None and choice.delta.content:
                        now = (time.perf_counter() - sent) * 1e3
                        if out.ttft_ms is None:
                            out.ttft_ms = now
                        out.last_token_ms = now
                        pieces.append(choice.delta.content)
                usage = chunk.usage or usage
    except openai.OpenAIError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.total_ms = (time.perf_counter() - sent) * 1e3
    out.text = "".join(pieces)
    if usage is None:
        out.error = "no usage in the stream (stream_options.include_usage)"
        return out
    out.prompt_tokens, out.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    details = usage.prompt_tokens_details
    out.cached_tokens = details.cached_tokens if details is not None else None
    if out.ttft_ms is None:
        out.error = "no content in the stream"
    return out
