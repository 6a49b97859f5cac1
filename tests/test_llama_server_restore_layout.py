"""Where a slot restore puts its cells in llama-server's KV cache (Docs/Research.md §7, the restore drift).

In-process, a restore once landed where the previous request had left llama.cpp's KV head, so each
later decode attended over a longer, emptier range; KVBridge now clears every cell before it
restores there. Through llama-server the restore is the server's own `action=restore`
(`llama_state_seq_load_file` -> `llama_kv_cache::state_read_meta`), which first drops the slot's
sequence (`seq_rm(dest_seq_id, -1, -1)`), and `seq_rm` moves the head back to the first cell it
freed. KVBridge runs its server with one slot (`--parallel 1`), whose sequence holds every used
cell, so the cache is empty at that point and the restored cells start at cell 0 without a patch,
a flag or an extra request: the drift of §7 does not happen in this server.

These tests pin that down with the server's own account of its cells, not with timings: with
LLAMA_KV_CACHE_DEBUG=3 llama.cpp's find_slot logs a map of every cell (`.` empty, a digit the
sequence holding it) and LLAMA_ARG_LOG_VERBOSITY=5 lets those debug lines into the server's log.
A llama.cpp update that changes where restores land fails here, not as a slower benchmark. The
second test shows the map check is not blind: a restore that cannot start at cell 0 (another
slot holds the start of a shared cache) is seen as such.
"""
from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest
import requests

from kvbridge.backends.base import EngineReport, Prompt
from kvbridge.backends.llama_server.backend import LlamaServerBackend
from kvbridge.backends.llama_server.process import (ServerProcess, built_binary, free_port,
                                                    pinned_llama_cpp_version)
from kvbridge.settings import EMBEDDED_MODEL_PATH, Settings
from conftest import needs_llama_server_and_model
from test_llama_server import prompt_for

BINARY = built_binary(pinned_llama_cpp_version())

pytestmark = needs_llama_server_and_model()

CTX = 1024   # cells in the cache: the map of each find_slot call is this many characters
SHORT = [{"role": "user", "content": "List three colours of the rainbow."}]

_HEADER = re.compile(r"find_slot: stream\[0\], n = *(\d+), used = *(\d+), head = *(\d+), size = *(\d+)")
_RESTORE = re.compile(r"state_read_meta: cell_count = (\d+), dest_seq_id = (\d+)")
_MAP_LINE = re.compile(r"^([.0-9M]+)(?: \*)?$")
_MAP_LOOKAHEAD = 200   # lines after a find_slot header in which its cell map is looked for


@dataclasses.dataclass
class SlotSearch:
    """One find_slot call as llama.cpp logs it: the cache before cells are placed for a ubatch."""

    line: int     # where in the log
    n: int        # used_max_p1: one past the highest used cell (what the attended range is padded from)
    used: int
    head: int
    cells: str    # one character per cell: '.' empty, '0'/'1' the sequence holding it, 'M' several


def kv_log(text: str) -> tuple[list[SlotSearch], list[tuple[int, int]]]:
    """The find_slot cell maps and the (line, cell_count) of every single-sequence state restore."""
    lines = text.splitlines()
    searches: list[SlotSearch] = []
    restores: list[tuple[int, int]] = []
    for i, line in enumerate(lines):
        restore = _RESTORE.search(line)
        if restore:
            restores.append((i, int(restore.group(1))))
            continue
        header = _HEADER.search(line)
        if not header:
            continue
        n, used, head, size = (int(g) for g in header.groups())
        cells = ""
        # the map follows as its own message; the server's other threads may log lines in between
        for follow in lines[i + 1: i + 1 + _MAP_LOOKAHEAD]:
            if len(cells) >= size or _HEADER.search(follow):
                break
            match = _MAP_LINE.match(follow.strip())
            if match:
                cells += match.group(1)
        if len(cells) == size:
            searches.append(SlotSearch(i, n, used, head, cells))
    return searches, restores


def around_last_restore(log_path: Path, cell_count: int,
                        timeout_s: float = 30.0) -> tuple[SlotSearch, SlotSearch, SlotSearch]:
    """Three cell maps around the last restore of `cell_count` cells: the last decode before it, the
    restore's own search for cells (after it dropped the slot's sequence) and the first decode after it.

    The server writes its log from a thread of its own, so the lines may trail the HTTP answer:
    this waits (bounded) until they are there; nothing here measures time."""
    deadline = time.monotonic() + timeout_s
    while True:
        searches, restores = kv_log(log_path.read_text(errors="replace"))
        ours = [line for line, count in restores if count == cell_count]
        if ours:
            before = [s for s in searches if s.line < ours[-1]]
            after = [s for s in searches if s.line > ours[-1]]
            if len(before) >= 2 and after:
                return before[-2], before[-1], after[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no find_slot cell map around a restore of {cell_count} cells in {log_path} "
                                 f"(restores seen: {restores}, cell maps: {len(searches)})")
        time.sleep(0.2)


def cells_of(search: SlotSearch, seq: str) -> list[int]:
    return [i for i, c in enumerate(search.cells) if c == seq]


@pytest.fixture
def kv_debug(monkeypatch):
    """The llama-server children of this test log their KV cells (both variables are read by the server)."""
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "3")
    monkeypatch.setenv("LLAMA_ARG_LOG_VERBOSITY", "5")


@pytest.fixture
def backend(tmp_path, kv_debug):
    settings = dataclasses.replace(Settings(), ctx_size=CTX, threads=1, chunk_size=16, n_predict=8,
                                   l2_dir=str(tmp_path / "l2"), llama_start_timeout=60.0)
    b = LlamaServerBackend(settings)
    b.start()
    yield b
    b.stop()


def run(backend, prompt: Prompt, native: bool) -> tuple[str, EngineReport]:
    report = EngineReport()
    text = "".join(backend.generate(prompt, n_predict=8, temperature=0.0, use_native_cache=native, report=report))
    return text, report


def test_a_short_restore_after_a_long_request_starts_at_cell_0(backend, short_doc):
    """KVBridge's own path (save_state / restore_state through slot files): after a long request,
    a short slot file restored into the server sits at cells 0.. with no empty cell below it."""
    short = prompt_for(backend, SHORT)
    short_text, _ = run(backend, short, native=True)
    state = backend.save_state()
    tokens = backend.context_tokens()

    long = prompt_for(backend, [{"role": "user", "content": short_doc + "\n\nSummarise the text above."}])
    assert len(long.tokens) > 3 * len(tokens)
    run(backend, long, native=False)   # the cache now holds the long request, its head far past the short one

    backend.restore_state(state, tokens)
    text, report = run(backend, short, native=True)
    assert report.engine_cached_tokens == len(short.tokens) - 1   # the server generated on the restored cells
    assert text == short_text

    before, during, after = around_last_restore(backend.server.log_path, len(tokens))
    # the restore really replaced a longer sequence: the cache held the long request up to then
    assert before.n >= len(long.tokens) and before.head >= len(long.tokens)
    # how: dropping the slot's sequence emptied the cache and moved the head back to cell 0
    assert (during.used, during.head) == (0, 0) and set(during.cells) == {"."}
    # the restored sequence sits at the start of the cache, with nothing below or beside it
    kept = report.engine_cached_tokens
    assert after.cells == "0" * kept + "." * (CTX - kept), after.cells[: kept + 16]
    assert after.n == after.used == kept   # used_max_p1: the attended range is as short as the prompt


def test_the_cell_map_sees_a_restore_that_does_not_start_at_cell_0(kv_debug, tmp_path, short_doc):
    """The check above is not blind: with two slots sharing one cache (`-np 2 --kv-unified`) and
    slot 1 holding its start, a restore into slot 0 lands after slot 1's cells, and the map says so."""
    args = ["--model", str(EMBEDDED_MODEL_PATH), "--ctx-size", str(CTX), "--threads", "1", "--threads-batch", "1",
            "--parallel", "2", "--kv-unified", "--cache-ram", "0", "--no-webui", "--no-warmup"]
    server = ServerProcess(BINARY, args, "127.0.0.1", free_port())
    server.start()
    try:
        server.wait_healthy(60.0)

        def complete(slot: int, text: str) -> None:
            body = {"prompt": text, "n_predict": 4, "id_slot": slot, "cache_prompt": True, "temperature": 0.0}
            requests.post(f"{server.url}/completion", json=body, timeout=120).raise_for_status()

        def slot_action(action: str) -> dict:
            resp = requests.post(f"{server.url}/slots/0?action={action}", json={"filename": "short.bin"}, timeout=60)
            resp.raise_for_status()
            return resp.json()

        complete(1, short_doc)                        # slot 1 takes the cells at the start of the cache
        complete(0, "List three colours of the rainbow.")
        n_saved = slot_action("save")["n_saved"]
        assert slot_action("restore")["n_restored"] == n_saved
        complete(0, "List three colours of the rainbow.")

        _, _, after = around_last_restore(server.log_path, n_saved)
        ones, zeros = cells_of(after, "1"), cells_of(after, "0")
        assert ones and ones[0] == 0            # slot 1 holds the start
        assert zeros and zeros[0] > ones[-1]    # so the restored sequence cannot start at cell 0
        assert after.cells != "0" * len(zeros) + "." * (CTX - len(zeros))   # the first test's check fails here
    finally:
        server.stop()
