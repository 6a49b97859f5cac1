"""A loopback HTTP server that replays scripted responses and records every request it got.

Used only for what cannot run here: hosted providers (no internet) and Ollama (no binary). The
backends talk real HTTP to it through their real client (requests); nothing is patched. Streamed
bodies go out with chunked transfer encoding, one flush per line, as real servers send them.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Union

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@dataclass
class Reply:
    """One scripted response. `chunks` set: streamed, one chunk per element."""

    status: int = 200
    body: bytes = b""
    chunks: list[bytes] | None = None
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    chunk_delay_s: float = 0.0

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict[str, str] | None = None) -> "Reply":
        return cls(status, json.dumps(obj).encode(), headers=dict(headers or {}))

    @classmethod
    def sse(cls, lines: list[str], chunk_delay_s: float = 0.0) -> "Reply":
        """Server-sent events: each element is one line on the wire (\"\" is the blank line)."""
        return cls(chunks=[(line + "\n").encode() for line in lines], content_type="text/event-stream",
                   chunk_delay_s=chunk_delay_s)

    @classmethod
    def ndjson(cls, lines: list[str], chunk_delay_s: float = 0.0) -> "Reply":
        return cls(chunks=[(line + "\n").encode() for line in lines], content_type="application/x-ndjson",
                   chunk_delay_s=chunk_delay_s)


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body) if self.body else None


Handler = Callable[[RecordedRequest], Reply]
Script = Union[Reply, Handler]


class ReplayServer:
    """`with ReplayServer() as server:` serves on 127.0.0.1:<free port> until the block ends.

    server.add("POST", "/v1/chat/completions", reply1, reply2): replies in order, the last repeats.
    A reply may be a function of the request. An unscripted path answers 404.
    """

    def __init__(self) -> None:
        self._scripts: dict[tuple[str, str], list[Script]] = {}
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add(self, method: str, path: str, *replies: Script) -> "ReplayServer":
        with self._lock:
            self._scripts.setdefault((method.upper(), path), []).extend(replies)
        return self

    def requests_to(self, path: str) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.path == path]

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def _next_reply(self, request: RecordedRequest) -> Reply:
        with self._lock:
            self.requests.append(request)
            queue = self._scripts.get((request.method, request.path))
            if not queue:
                return Reply.json({"error": f"replay server: nothing scripted for {request.method} {request.path}"},
                                  status=404)
            script = queue.pop(0) if len(queue) > 1 else queue[0]
        return script(request) if callable(script) else script

    def __enter__(self) -> "ReplayServer":
        replay = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?", 1)[0]
                reply = replay._next_reply(RecordedRequest(self.command, path, dict(self.headers), body))
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                if reply.chunks is None:
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in reply.chunks:
                    if reply.chunk_delay_s:
                        time.sleep(reply.chunk_delay_s)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            do_GET = do_POST = do_DELETE = _serve

            def log_message(self, format: str, *args) -> None:  # keep test output quiet
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="replay-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._httpd is not None and self._thread is not None
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def load_fixture(name: str):
    """A fixture from tests/fixtures: .json parsed, .ndjson as its list of raw lines."""
    path = FIXTURES / name
    text = path.read_text(encoding="utf-8")
    return text.splitlines() if path.suffix == ".ndjson" else json.loads(text)
