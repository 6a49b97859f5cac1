"""The llama-server KVBridge builds carries patches/llama.cpp, and the patch does what it says.

patches/llama.cpp/0001-slot-restore-maps-the-state.patch makes `POST /slots/N?action=restore` read
the sequence state from one mapping of the slot file instead of one read() per row of every layer
(V is transposed with flash attention off, KVBridge's default). Measured without timings: the
server's own count of read system calls (`syscr` in /proc/PID/io) across one restore. Unpatched, a
restore reads each of SmolLM2's n_layer x n_embd_v_gqa = 30 x 192 = 5760 V rows on its own, through
stdio's 4 KiB buffer: 1027 read() calls for the ~300-token state here, one per row at 2k tokens;
patched, a handful (the HTTP request itself). A truncated slot file is still refused whole, and the server
keeps answering as before.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from kvbridge.backends.llama_server.backend import LlamaServerBackend
from kvbridge.backends.llama_server.slots import RestoreFailed
from kvbridge.backends.llama_server.process import built_build_info, pinned_llama_cpp_version
from kvbridge.formats.slot_file import build_slot_file
from kvbridge.settings import WORK_DIR, Settings
from conftest import needs_llama_server_and_model
from test_llama_server import prompt_for, run

PATCHES = sorted((WORK_DIR / "patches" / "llama.cpp").glob("*.patch"))

pytestmark = needs_llama_server_and_model()


def patch_digest() -> str:
    """What scripts/build_llama_server.sh puts after `.kvb-` in the build's commit."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in PATCHES)).hexdigest()[:8]


def read_syscalls(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/io has no syscr line")


@pytest.fixture
def backend(tmp_path):
    settings = dataclasses.replace(Settings(), ctx_size=2048, threads=1, chunk_size=16, n_predict=8,
                                   l2_dir=str(tmp_path / "l2"), llama_start_timeout=60.0)
    b = LlamaServerBackend(settings)
    b.start()
    yield b
    b.stop()


def test_the_built_server_names_its_patches_in_its_build_info(backend):
    assert PATCHES, "patches/llama.cpp holds the patches the build applies"
    expected = f".kvb-{patch_digest()}"
    assert backend.build_info.endswith(expected), (
        f"llama-server reports build_info {backend.build_info!r}, not a build with the current patches "
        f"({expected}): run ./scripts/build_llama_server.sh")
    # the in-process engine and this server still share one namespace (same llama.cpp, same KV bytes)
    assert backend.build_info == built_build_info(pinned_llama_cpp_version())
    assert backend.kv_fingerprint()["llama_cpp_python"] == pinned_llama_cpp_version()


def test_a_slot_restore_reads_the_state_without_a_system_call_per_row(backend, short_doc):
    prompt = prompt_for(backend, [{"role": "user", "content": short_doc + "\n\nSummarise the text above."}])
    assert len(prompt.tokens) > 300
    cold_text, _, _ = run(backend, prompt, native=False)
    state = backend.save_state()
    tokens = backend.context_tokens()
    backend.reset_native_cache()

    before = read_syscalls(backend.server.pid)
    backend.restore_state(state, tokens)
    reads = read_syscalls(backend.server.pid) - before
    assert backend.held_tokens() == len(tokens)
    assert reads < 200, f"one restore made {reads} read system calls (unpatched: over 1000)"

    text, report, _ = run(backend, prompt, native=True)
    assert report.engine_cached_tokens == len(prompt.tokens) - 1   # generated on the restored cells
    assert text == cold_text


def test_a_truncated_slot_file_is_refused_whole_and_the_server_answers_on(backend, short_doc):
    prompt = prompt_for(backend, [{"role": "user", "content": short_doc + "\n\nSummarise the text above."}])
    cold_text, _, _ = run(backend, prompt, native=False)
    state = backend.save_state()
    tokens = backend.context_tokens()

    whole = b"".join(bytes(part) for part in build_slot_file(state.data, tokens))
    (backend.slot_dir / "cut.bin").write_bytes(whole[: len(whole) - len(state.data) // 2])
    with pytest.raises(RestoreFailed, match="Unable to restore slot"):
        backend._restore_file("cut.bin", wanted=len(tokens))

    text, report, _ = run(backend, prompt, native=True)
    assert report.engine_cached_tokens in (0, None)   # nothing of the cut file was kept
    assert text == cold_text
