"""What a killed cache server leaves behind, found from its address and removed.

A clean stop removes the server's token file, key file and L1 segment itself (CacheServer.close).
SIGKILL (a fleet's bounded stop, the OOM killer) leaves all three: the files in this user's
~/.cache/kvbridge/run, the segment in /dev/shm holding its memory. The key file records the
server's pid and its segment's path (curve.write_key_file), so the address alone finds everything;
`forget_server_files` removes it once the server is known to be gone, and a server starting on an
address calls it first, so what its killed predecessor left goes then at the latest.

The segment is removed only when it is this user's regular segment file whose creator is gone
(shm.is_stale_segment: its creator lock is free and its pid dead); while the recorded server still
runs, nothing is touched.
"""
from __future__ import annotations

import logging
from pathlib import Path

from kvbridge.cache_server.auth import UntrustedFile, token_file
from kvbridge.cache_server.curve import key_file, read_key_file
from kvbridge.cache_server.shm import creator_alive, pid_alive, remove_if_stale

log = logging.getLogger("kvbridge.cache_server")


def forget_server_files(url: str) -> list[Path]:
    """Remove what a killed cache server of this user left for `url` (token file, key file, shared-memory
    segment); the paths removed. Nothing is removed while the server its key file names still runs."""
    record = _record(url)
    pid = int(record.get("pid", "0") or 0)
    segment = Path(record["segment"]) if record.get("segment") else None
    if _still_runs(pid, segment):
        log.warning("left the files of the cache server at %s alone: the server that wrote them (pid %d) still runs",
                    url, pid)
        return []
    removed = [segment] if segment is not None and remove_if_stale(segment) else []
    for path in (token_file(url), key_file(url)):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _record(url: str) -> dict[str, str]:
    """The key file's fields; {} when there is none or it cannot be read (then only the files are removed)."""
    try:
        return read_key_file(key_file(url)) or {}
    except (UntrustedFile, ValueError) as exc:
        log.warning("the key file of the cache server at %s names no server to clean up after: %s", url, exc)
        return {}


def _still_runs(pid: int, segment: Path | None) -> bool:
    if segment is not None:   # a running server keeps its segment; its creator lock says it runs
        return segment.exists() and creator_alive(segment, pid)
    return bool(pid) and pid_alive(pid)
