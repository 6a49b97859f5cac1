"""LlamaServerBackend against a real llama-server (built by scripts/build_llama_server.sh) on the embedded model.

Contracts: restored output equals cold output at temperature 0 after the context held something
else; the server's KV bytes equal the in-process engine's, so both share one namespace; every
failure a person can cause ends in an EngineUnavailable naming the setting; no process survives.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from kvbridge.backends.base import EngineReport, Prompt
from kvbridge.backends.llama_server.backend import LlamaServerBackend
from kvbridge.backends.llama_server.process import built_binary, pinned_llama_cpp_version
from kvbridge.settings import EMBEDDED_MODEL_PATH, WORK_DIR, Settings
from kvbridge.errors import EngineUnavailable

BINARY = built_binary(pinned_llama_cpp_version())
BUILDABLE = bool(shutil.which("cmake") and shutil.which("g++"))

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(not BINARY.is_file() and not BUILDABLE,
                       reason=f"llama-server is not built ({BINARY}) and cmake/g++ are missing to build it"),
    pytest.mark.skipif(not EMBEDDED_MODEL_PATH.is_file(),
                       reason=f"embedded model {EMBEDDED_MODEL_PATH} missing: run ./scripts/setup.sh"),
]

QUESTION = [{"role": "user", "content": "Tell me a short story about a cat named Tom, in three sentences."}]
OTHER = [{"role": "user", "content": "List three colours of the rainbow."}]


def our_llama_servers() -> list[int]:
    """PIDs of llama-server processes that are children of this test process (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if comm == "llama-server" and int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module", autouse=True)
def server_binary_and_no_orphans():
    if not BINARY.is_file():  # test.sh builds it first; this covers a plain `pytest`
        subprocess.run([str(WORK_DIR / "scripts" / "build_llama_server.sh")], check=True)
    yield BINARY
    assert our_llama_servers() == [], "a llama-server child outlived its tests"


@pytest.fixture
def settings(tmp_path) -> Settings:
    return small_settings(tmp_path / "l2")


def small_settings(l2_dir: Path) -> Settings:
    # one thread: on a shared 2-core machine two spinning threads slow llama.cpp down tenfold
    return dataclasses.replace(Settings(), ctx_size=2048, threads=1, chunk_size=16, n_predict=12,
                               l2_dir=str(l2_dir), llama_start_timeout=60.0)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """One llama-server for the module's tests that need a running one (each leaves it running, with any
    slot content: every test first runs its own cold request); a test that kills it restarts it."""
    b = LlamaServerBackend(small_settings(tmp_path_factory.mktemp("l2")))
    b.start()
    yield b
    b.stop()


def prompt_for(backend, messages) -> Prompt:
    text = backend.render(messages)
    return Prompt(text=text, tokens=tuple(backend.tokenize(text)), messages=tuple(messages))


def run(backend, prompt: Prompt, native: bool, n_predict: int = 12) -> tuple[str, EngineReport, int]:
    report = EngineReport()
    pieces = list(backend.generate(prompt, n_predict=n_predict, temperature=0.0, use_native_cache=native,
                                   report=report))
    return "".join(pieces), report, len(pieces)


# lifecycle ---------------------------------------------------------------------------------
def test_start_and_stop_leave_no_process_or_files(settings):
    b = LlamaServerBackend(settings)
    b.start()
    pid, work_dir = b.server.pid, b.server.work_dir
    assert not process_gone(pid) and work_dir.is_dir()
    assert "own process" in b.describe()
    b.stop()
    assert process_gone(pid)
    assert not work_dir.exists()
    b.stop()  # idempotent


def test_killed_server_fails_clearly_then_restart_gives_a_fresh_one(backend):
    prompt = prompt_for(backend, QUESTION)
    old_pid = backend.server.pid
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while backend.server.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(EngineUnavailable, match="did not answer"):
        run(backend, prompt, native=False)
    backend.restart()
    assert backend.server.pid != old_pid and process_gone(old_pid)
    text, report, _ = run(backend, prompt, native=False)
    assert text and report.engine_cached_tokens == 0


# tokens and generation ---------------------------------------------------------------------
def test_tokenize_matches_the_in_process_tokenizer(backend):
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab = llama_cpp.Llama(model_path=str(EMBEDDED_MODEL_PATH), vocab_only=True, verbose=False)
    samples = ["Hello world", "  two spaces\n\n\ttab", "Héllo ünïcode ✓ 日本語 🐈", "",
               backend.render(QUESTION)]  # with the chat template's special tokens
    for text in samples:
        assert backend.tokenize(text) == vocab.tokenize(text.encode(), add_bos=True, special=True), text
    ids = backend.tokenize("Paris is the capital of France.")
    assert backend.detokenize(ids) == "Paris is the capital of France."


def test_generation_streams_and_reports_the_server_cache(backend):
    prompt = prompt_for(backend, QUESTION)
    n = len(prompt.tokens)
    cold_text, cold, pieces = run(backend, prompt, native=False)
    assert pieces > 1 and cold_text.strip()
    assert cold.engine_cached_tokens == 0 and cold.engine_prefill_tokens == n
    assert cold.completion_tokens == 12 and any("cache_prompt=false" in note for note in cold.notes)
    warm_text, warm, _ = run(backend, prompt, native=True)
    assert warm.engine_cached_tokens == n - 1 and warm.engine_prefill_tokens == 1  # llama.cpp re-evaluates one
    assert warm_text == cold_text


def test_save_then_restore_after_other_work_gives_cold_output(backend):
    prompt = prompt_for(backend, QUESTION)
    cold_text, _, _ = run(backend, prompt, native=False)
    state = backend.save_state()
    tokens = backend.context_tokens()
    assert state.n_tokens == len(tokens) == len(prompt.tokens) + 11  # prompt + generated but the last
    assert tokens[: len(prompt.tokens)] == list(prompt.tokens)

    run(backend, prompt_for(backend, OTHER), native=False)   # the slot now holds something else
    backend.reset_native_cache()
    backend.restore_state(state, tokens)
    assert backend.context_tokens() == tokens
    assert backend.last_restore_ms is not None
    text, report, _ = run(backend, prompt, native=True)
    assert report.engine_cached_tokens == len(prompt.tokens) - 1  # the restore was really used
    assert text == cold_text


def test_state_bytes_equal_the_in_process_engine(backend, settings):
    pytest.importorskip("llama_cpp")
    from kvbridge.backends.llamacpp import LlamaCppBackend

    prompt = prompt_for(backend, QUESTION)
    server_text, _, _ = run(backend, prompt, native=False, n_predict=4)
    in_process = LlamaCppBackend(settings)
    in_process.start()
    try:
        assert in_process.kv_fingerprint() == backend.kv_fingerprint()
        report = EngineReport()
        local_text = "".join(in_process.generate(prompt, n_predict=4, temperature=0.0, use_native_cache=False,
                                                 report=report))
        assert local_text == server_text
        local = in_process.save_state()
        remote = backend.save_state()
        assert in_process.context_tokens() == backend.context_tokens()
        assert bytes(local.data) == bytes(remote.data)
    finally:
        in_process.stop()


def test_a_corrupt_state_is_refused_not_restored(backend):
    from kvbridge.backends.llama_server.slots import RestoreFailed

    prompt = prompt_for(backend, QUESTION)
    run(backend, prompt, native=False, n_predict=2)
    state = backend.save_state()
    tokens = backend.context_tokens()
    broken = dataclasses.replace(state, data=bytes(state.data)[: len(state.data) // 2])
    with pytest.raises(RestoreFailed):
        backend.restore_state(broken, tokens)
    leftovers = {p.name for p in backend.server.slot_dir.iterdir()}
    assert leftovers <= {backend._restore_name}   # saves are removed; one restore file is reused
    text, report, _ = run(backend, prompt, native=True, n_predict=2)
    assert report.engine_cached_tokens == 0 and text  # the slot was cleared, nothing half-restored


# attach mode ---------------------------------------------------------------------------------
def test_attach_without_local_slot_dir_saves_and_restores_by_name(backend, settings):
    attached = LlamaServerBackend(dataclasses.replace(settings, llama_server_url=backend.base_url))
    attached.start()
    try:
        assert attached.kv_by_reference and "not on this machine" in attached.describe()
        prompt = prompt_for(attached, QUESTION)
        cold_text, _, _ = run(attached, prompt, native=False)
        state = attached.save_state()
        tokens = attached.context_tokens()
        run(attached, prompt_for(attached, OTHER), native=False)
        attached.reset_native_cache()
        attached.restore_state(state, tokens)
        text, report, _ = run(attached, prompt, native=True)
        assert report.engine_cached_tokens == len(prompt.tokens) - 1 and text == cold_text
    finally:
        attached.stop()
    assert backend.server.alive()  # stopping an attached backend leaves the server alone


@dataclasses.dataclass(frozen=True)
class SettingsWithSlotDir(Settings):
    """KVB_LLAMA_SERVER_SLOT_DIR: the attached server's --slot-save-path, seen from this machine."""

    llama_server_slot_dir: str = ""


def test_attach_with_a_local_slot_dir_moves_real_kv(backend, settings):
    from kvbridge.formats.llama_state import parse_state

    attached = LlamaServerBackend(SettingsWithSlotDir(**{
        **dataclasses.asdict(settings), "llama_server_url": backend.base_url,
        "llama_server_slot_dir": str(backend.server.slot_dir)}))
    attached.start()
    try:
        assert not attached.kv_by_reference and "attached" in attached.describe()
        prompt = prompt_for(attached, QUESTION)
        cold_text, _, _ = run(attached, prompt, native=False)
        state = attached.save_state()
        assert parse_state(state.data).n_cells == state.n_tokens   # real KV bytes, not a reference
        tokens = attached.context_tokens()
        run(attached, prompt_for(attached, OTHER), native=False)
        attached.restore_state(state, tokens)
        text, report, _ = run(attached, prompt, native=True)
        assert report.engine_cached_tokens == len(prompt.tokens) - 1 and text == cold_text
    finally:
        attached.stop()


# clear errors --------------------------------------------------------------------------------
def test_missing_binary_names_the_setting_and_the_build_script(settings, tmp_path):
    b = LlamaServerBackend(dataclasses.replace(settings, llama_server_bin=str(tmp_path / "nope" / "llama-server")))
    with pytest.raises(EngineUnavailable, match="KVB_LLAMA_SERVER_BIN") as err:
        b.start()
    assert "build_llama_server.sh" in str(err.value)


def test_a_binary_that_exits_shows_its_log(settings, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: this is not llama-server' >&2\nexit 3\n")
    fake.chmod(0o755)
    b = LlamaServerBackend(dataclasses.replace(settings, llama_server_bin=str(fake)))
    with pytest.raises(EngineUnavailable, match="exited with code 3") as err:
        b.start()
    assert "this is not llama-server" in str(err.value)


def test_port_in_use_names_the_setting(settings):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        b = LlamaServerBackend(dataclasses.replace(settings, llama_server_port=port))
        with pytest.raises(EngineUnavailable, match="KVB_LLAMA_SERVER_PORT"):
            b.start()


def test_missing_model_names_the_setting(settings, tmp_path):
    b = LlamaServerBackend(dataclasses.replace(settings, model_path=str(tmp_path / "missing.gguf")))
    with pytest.raises(EngineUnavailable, match="KVB_MODEL_PATH"):
        b.start()


def test_unreachable_attach_url_names_the_setting(settings):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connection refused
        b = LlamaServerBackend(dataclasses.replace(settings, llama_server_url=f"http://127.0.0.1:{port}"))
        with pytest.raises(EngineUnavailable, match="KVB_LLAMA_SERVER_URL"):
            b.start()


def test_server_errors_carry_the_servers_own_message(backend):
    from kvbridge.backends.base import SeqState
    from kvbridge.backends.llama_server.slots import SLOT_REF_MAGIC, RestoreFailed

    missing = SeqState(data=SLOT_REF_MAGIC + struct.pack("<I", 3) + b"kvb-slot-missing.bin", n_tokens=3)
    with pytest.raises(RestoreFailed, match=r"llama-server /slots/0\?action=restore failed \(\d+\): .*restore") as err:
        backend.restore_state(missing, [1, 2, 3])
    assert "Traceback" not in str(err.value)


def test_a_killed_owners_leftovers_are_removed_at_the_next_start(settings):
    from kvbridge.backends.llama_server.process import WORK_DIR_PREFIX, scratch_dir

    dead = subprocess.Popen(["true"])
    dead.wait()  # a PID that no longer exists
    parent = Path(scratch_dir())
    stale = parent / f"{WORK_DIR_PREFIX}{dead.pid}-test"
    (stale / "slots").mkdir(parents=True)
    (stale / "slots" / "kvb-restore-left.bin").write_bytes(b"x" * 1024)
    b = LlamaServerBackend(settings)
    b.start()
    try:
        assert not stale.exists()
    finally:
        b.stop()


def test_an_attached_server_of_the_same_build_shares_the_namespace_keys(backend, settings):
    attached = LlamaServerBackend(dataclasses.replace(settings, llama_server_url=backend.base_url))
    attached.start()
    try:
        assert attached.kv_fingerprint() == backend.kv_fingerprint()
        assert backend.kv_fingerprint()["llama_cpp_python"] == pinned_llama_cpp_version()
        attached.build_info = "b9999-0000000"   # another llama.cpp: its own namespace
        assert attached.kv_fingerprint()["llama_cpp_python"] == "llama-server b9999-0000000"
    finally:
        attached.stop()


def test_an_attached_server_whose_model_is_not_here_is_keyed_by_what_it_reports(settings, tmp_path):
    """The model file cannot be hashed from here: /props and /v1/models identify it in the namespace."""
    elsewhere = tmp_path / "elsewhere.gguf"
    shutil.copyfile(EMBEDDED_MODEL_PATH, elsewhere)
    own = LlamaServerBackend(dataclasses.replace(settings, model_path=str(elsewhere)))
    own.start()
    try:
        elsewhere.unlink()   # the server keeps the model it loaded; this machine no longer has the file
        attached = LlamaServerBackend(dataclasses.replace(settings, llama_server_url=own.base_url))
        attached.start()
        try:
            assert attached.model_file() is None
            keys = attached.kv_fingerprint()
            assert keys["server_model_path"] == str(elsewhere)
            assert int(keys["server_model_n_params"]) > 100_000_000 and int(keys["server_model_size"]) > 0
            assert keys["server_n_ctx"] == str(settings.ctx_size) and keys["server_total_slots"] == "1"
            assert "server_run" not in keys and "does not identify" not in attached.describe()
        finally:
            attached.stop()
    finally:
        own.stop()
