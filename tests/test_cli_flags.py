"""The flags that mirror llama-server (issue 36, item 1): `kvbridge serve -m PATH -c 4096 --port P` run as a
user runs it (an empty folder, no KVB_ variable, a fresh HOME) and asked by the `openai` SDK; then, without a
process, the table (kvbridge.settings.flags) against Settings and the reference page, a flag winning over the
environment and `.env`, a bad value named by its flag, cache-server's --host/--port, and the key file's rules.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import needs_model
from kvbridge.cli.commands import build_parser
from kvbridge.cli.common import settings_with_flags
from kvbridge.errors import BadSettings
from kvbridge.settings import EMBEDDED_MODEL_PATH, SETTING_NAMES, Settings, env_name, settings_to_env
from kvbridge.settings import core as settings_core
from kvbridge.settings.flags import CACHE_SERVER, COMMANDS, FLAGS, GUI, SERVE, flags_for, overrides
from kvbridge.settings.reference import REFERENCE_PAGE
from kvbridge.settings.secrets import secret_from_file
from process_helpers import free_port

KVBRIDGE = Path(sys.executable).parent / "kvbridge"   # the console script pip installed beside this python
KEY = "sk-flag-test-0123456789"


def parsed(*argv: str):
    return build_parser().parse_args(list(argv))


def flag_settings(*argv: str) -> Settings:
    return settings_with_flags(argv[0], parsed(*argv), strict=False)


@needs_model
@pytest.mark.skipif(not KVBRIDGE.is_file(), reason=f"no console script {KVBRIDGE}: pip install -e . first")
def test_serve_m_runs_from_an_empty_folder_with_nothing_else_set(tmp_path):
    openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")
    home, empty = tmp_path / "home", tmp_path / "empty"
    (home / "models").mkdir(parents=True)
    empty.mkdir()
    (home / "models" / "x.gguf").symlink_to(EMBEDDED_MODEL_PATH)   # a GGUF outside the checkout
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVB_", "XDG_"))}
    env["HOME"] = str(home)
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:   # `~` as a user quoting it would pass it: serve expands it itself
        proc = subprocess.Popen([str(KVBRIDGE), "serve", "-m", "~/models/x.gguf", "-c", "4096", "--port", str(port)],
                                cwd=empty, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "KVBridge serve ready on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="x", max_tokens=4, temperature=0,
                                                messages=[{"role": "user", "content": "Say hello."}])
        assert answer.choices[0].message.content and answer.usage.completion_tokens >= 1
        assert [m.id for m in client.models.list().data] == ["x"]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    said = log_path.read_text()
    assert code == 0 and "serve stopped." in said, said
    assert f"{home}/models/x.gguf, context 4096 tokens a request of 4096 shared (-c)" in said   # -m expanded, -c taken
    assert (home / ".cache" / "kvbridge" / "l2").is_dir() and not os.listdir(empty)   # L2 under HOME, cwd untouched


def test_every_flag_sets_a_real_setting_of_its_type_and_its_help_says_which():
    for flag in FLAGS:
        assert set(flag.fields) <= set(COMMANDS) and flag.spellings[-1].startswith("--")
        for command, field in flag.fields.items():
            assert field in SETTING_NAMES, (flag.name, field)
            if field != "cache_server_url":   # cache-server's --host/--port both make one URL
                kind = type(getattr(Settings(), field))
                assert (flag.kind == "int") == (kind is int), flag.name
                assert (flag.kind in ("switch", "onoff")) == (kind is bool), flag.name
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            parsed(command, "--help")
    helps = {command: " ".join(build_parser()._subparsers._group_actions[0].choices[command].format_help().split())
             for command in COMMANDS}
    for command in COMMANDS:
        for flag in flags_for(command):
            assert f"{', '.join(flag.spellings[:1])} {flag.metavar}" in helps[command]
            field = flag.fields[command]
            if field != "cache_server_url":
                assert env_name(field) in helps[command]
    assert "[KVB_CTX_SIZE; default 4096]" in helps[SERVE] and "[KVB_PORT; default 7860]" in helps[GUI]
    assert "[KVB_SERVE_PORT; default 8000]" in helps[SERVE] and "default 5555" in helps[CACHE_SERVER]
    assert "--model" not in helps[CACHE_SERVER] and "--api-key-file" not in helps[GUI]


def test_the_reference_page_holds_the_table():
    rows = {line.split(" | ")[0]: line for line in REFERENCE_PAGE.read_text(encoding="utf-8").splitlines()
            if line.startswith("| `-")}
    for flag in FLAGS:
        row = rows["| " + ", ".join(f"`{s}`" for s in flag.spellings)]
        assert all(f"`{env_name(field)}`" in row for field in flag.fields.values()), row


def test_a_flag_wins_over_the_environment_and_the_env_file(tmp_path, monkeypatch):
    env_file = tmp_path / "no-project.env"   # the file conftest's isolation names as the project's .env
    env_file.write_text("KVB_SERVE_PORT=9000\nKVB_CACHE_TYPE_K=f16\nKVB_THREADS=5\n")
    monkeypatch.setattr(settings_core, "DEFAULT_ENV_FILE", env_file)
    monkeypatch.setenv("KVB_CTX_SIZE", "2048")
    monkeypatch.setenv("KVB_SCHED_MAX_RUNNING", "8")
    monkeypatch.setenv("KVB_OLLAMA_MODEL", "llama3")
    monkeypatch.chdir(tmp_path)
    Path("model.gguf").write_bytes(b"GGUF")
    assert (Settings.from_env().serve_port, Settings.from_env().ctx_size) == (9000, 2048)   # what they say alone

    s = flag_settings("serve", "-m", "model.gguf", "-c", "4096", "-t", "3", "-np", "2", "--host", "127.0.0.2",
                      "--port", "8081", "-ctk", "f32", "-ctv", "f32")
    assert (s.model_path, s.ctx_size, s.threads, s.sched_max_running) == (str(tmp_path / "model.gguf"), 2048, 3, 2)
    assert s.sched_kv_cells == 4096   # -c is the KV shared, split across the -np slots given (llama-server's -c)
    assert (s.serve_host, s.serve_port, s.cache_type_k, s.cache_type_v) == ("127.0.0.2", 8081, "f32", "f32")
    assert s.ollama_model == "" and s.threads == 3   # serve's -m names the model, not KVB_OLLAMA_MODEL
    assert flag_settings("serve").serve_port == 9000 and flag_settings("serve").ctx_size == 2048   # no flag: env

    monkeypatch.setenv("KVB_MODEL_PATH", str(tmp_path / "model.gguf"))
    gui = parsed("gui", "-m", "gemma3-270m", "--host", "127.0.0.3", "--port", "7000", "-np", "3")
    named = Settings.from_env().replace(**overrides(GUI, vars(gui), Settings.from_env()))   # no model file needed
    assert (named.model, named.model_path, named.ollama_model) == ("gemma3-270m", "", "llama3")
    assert (named.host, named.port, named.sched_max_running, named.serve_port) == ("127.0.0.3", 7000, 3, 9000)


def test_a_bad_value_is_refused_naming_the_flag(capsys, tmp_path):
    with pytest.raises(SystemExit) as not_a_number:
        parsed("serve", "-c", "abc")
    assert not_a_number.value.code == 2 and "-c/--ctx-size: invalid int value: 'abc'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad_type:
        flag_settings("serve", "-ctk", "q9")
    assert "KVB_CACHE_TYPE_K='q9' is not a KV cache type" in str(bad_type.value)
    assert "(given on the command line: -ctk q9)" in str(bad_type.value)
    with pytest.raises(SystemExit) as missing:
        flag_settings("serve", "-m", str(tmp_path / "none.gguf"), "--port", "8081")
    assert "KVB_MODEL_PATH" in str(missing.value) and "(given on the command line: -m " in str(missing.value)
    assert "--port" not in str(missing.value)   # only the flag that caused it is named


def test_cache_server_host_and_port_make_its_url(monkeypatch):
    assert flag_settings("cache-server", "--port", "6000").cache_server_url == "tcp://127.0.0.1:6000"
    monkeypatch.setenv("KVB_CACHE_SERVER_URL", "tcp://127.0.0.1:7000")
    assert flag_settings("cache-server", "--host", "::1").cache_server_url == "tcp://[::1]:7000"
    assert flag_settings("cache-server").cache_server_url == "tcp://127.0.0.1:7000"
    from kvbridge.cli import cache_server

    with pytest.raises(SystemExit, match="--url tcp://127.0.0.1:1 names the whole address; give it or --host/--port"):
        cache_server.run(parsed("cache-server", "--url", "tcp://127.0.0.1:1", "--port", "6000"))


def key_file(tmp_path: Path, text: str = f"  {KEY}\n", mode: int = 0o600) -> Path:
    path = tmp_path / "serve.key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_key_file_is_a_key_like_the_variable(tmp_path):
    from kvbridge.serve.server import api_key_from, tenants_from

    path = key_file(tmp_path)
    s = flag_settings("serve", "--api-key-file", str(path), "--host", "0.0.0.0")   # beyond loopback: a key suffices
    assert s.serve_api_key_file == str(path) and api_key_from(s, {}) == KEY
    table = tenants_from(s, {})
    assert table.required and table.resolve(KEY.encode()).name == "default"
    assert KEY not in repr(s) + str(settings_to_env(s)) + "".join(s.validate())   # the path travels, never the key
    with pytest.raises(SystemExit, match="with no key"):
        flag_settings("serve", "--host", "0.0.0.0")


def test_the_key_file_must_be_yours_alone_nonempty_and_not_beside_the_variable(tmp_path, monkeypatch):
    from kvbridge.serve.server import api_key_from

    open_to_all = key_file(tmp_path, mode=0o644)
    with pytest.raises(SystemExit) as refused:
        flag_settings("serve", "--api-key-file", str(open_to_all))
    said = str(refused.value)
    assert f"chmod 600 {open_to_all}" in said and "mode 0644" in said and "--api-key-file" in said
    with pytest.raises(BadSettings, match="chmod 600") as at_start:
        secret_from_file("KVB_SERVE_API_KEY_FILE", str(open_to_all))
    assert KEY not in said + str(at_start.value)   # never echoed

    empty = key_file(tmp_path, text=" \n")
    with pytest.raises(BadSettings, match="is empty"):
        api_key_from(Settings(serve_api_key_file=str(empty)), {})
    with pytest.raises(BadSettings, match="more than one word"):
        api_key_from(Settings(serve_api_key_file=str(key_file(tmp_path, text=f"{KEY} second\n"))), {})
    from kvbridge.serve.server import tenants_from   # llama-server's file: a key a line, `#` lines comments

    several = Settings(serve_api_key_file=str(key_file(tmp_path, text=f"# ours\n{KEY}\n\n  second-key-0123 \n")))
    table = tenants_from(several, {})
    assert [table.resolve(k.encode()).name for k in (KEY, "second-key-0123")] == ["default", "default"]
    assert table.resolve(b"# ours") is None and table.resolve(b"ours") is None
    with pytest.raises(BadSettings, match="is empty"):
        api_key_from(Settings(serve_api_key_file=str(key_file(tmp_path, text="# only a comment\n"))), {})
    with pytest.raises(SystemExit, match="does not exist"):
        flag_settings("serve", "--api-key-file", str(tmp_path / "absent.key"))

    monkeypatch.setenv("KVB_SERVE_API_KEY_ENV", "SERVE_KEY")
    both = key_file(tmp_path)
    with pytest.raises(SystemExit, match="KVB_SERVE_API_KEY_FILE .*and KVB_SERVE_API_KEY_ENV .*keep one"):
        flag_settings("serve", "--api-key-file", str(both))
    with pytest.raises(BadSettings, match="KVB_SERVE_API_KEY_FILE .*KVB_SERVE_API_KEY_ENV"):
        api_key_from(Settings(serve_api_key_file=str(both), serve_api_key_env="SERVE_KEY"), {"SERVE_KEY": "x"})


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_of_another_user_is_refused(tmp_path):
    path = key_file(tmp_path)
    os.chown(path, 12345, -1)
    with pytest.raises(BadSettings, match="belongs to another user .*chmod 600"):
        secret_from_file("KVB_SERVE_API_KEY_FILE", str(path))


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_systemd_credential_is_trusted_whoever_owns_it(tmp_path, monkeypatch):
    """systemd's LoadCredential= copy is root's with an ACL for the service (deploy/systemd/): inside
    $CREDENTIALS_DIRECTORY it is read; the same file anywhere else is refused."""
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    path = key_file(credentials)
    os.chown(path, 12345, -1)
    path.chmod(0o640)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    assert secret_from_file("KVB_SERVE_API_KEY_FILE", str(path)) == KEY
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "elsewhere"))
    with pytest.raises(BadSettings, match="belongs to another user"):
        secret_from_file("KVB_SERVE_API_KEY_FILE", str(path))


def test_serves_llama_server_table_is_the_flags_table():
    import re

    from kvbridge.settings.flags import llama_server_table

    page = (Path(__file__).resolve().parents[1] / "Docs" / "Serve.md").read_text()
    found = re.search(r"<!-- llama-server-flags: begin -->\n(.*?)\n<!-- llama-server-flags: end -->", page, re.S)
    assert found, "Docs/Serve.md lost its llama-server-flags markers"
    assert found.group(1) == llama_server_table(), ("Docs/Serve.md's 'Coming from llama-server' table differs from "
                                                   "kvbridge.settings.flags: paste llama_server_table() between the markers")


def test_llama_arg_variables_set_what_their_flags_set_and_the_command_line_wins(monkeypatch, tmp_path):
    for name in [n for n in os.environ if n.startswith("LLAMA_ARG_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LLAMA_ARG_MODEL", str(EMBEDDED_MODEL_PATH))
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "2048")
    monkeypatch.setenv("LLAMA_ARG_PORT", "8123")
    monkeypatch.setenv("LLAMA_ARG_CACHE_TYPE_K", "q8_0")
    monkeypatch.setenv("KVB_CTX_SIZE", "1024")   # a flag's variable wins over KVB_, as the flag does
    s = flag_settings("serve")
    assert (s.model_path, s.ctx_size, s.serve_port, s.cache_type_k) == (str(EMBEDDED_MODEL_PATH), 2048, 8123, "q8_0")
    s = flag_settings("serve", "-c", "4096", "--port", "8124")
    assert (s.ctx_size, s.serve_port) == (4096, 8124)
    assert flag_settings("gui").port != 8123   # llama-server's variables are serve's, the drop-in's, only


def test_llama_server_flags_serve_ignores_say_why_and_hf_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_N_GPU_LAYERS", "99")
    s = flag_settings("serve", "-ngl", "99", "-cb", "--metrics", "--jinja", "--no-webui", "-cram", "0",
                      "--slot-save-path", "/tmp/slots", "-c", "2048")
    assert s.ctx_size == 2048
    said = capsys.readouterr().err
    for flag in ("-ngl", "-cb", "--metrics", "--jinja", "--no-webui", "-cram", "--slot-save-path"):
        assert f"{flag} is accepted and ignored: " in said, flag
    assert "LLAMA_ARG_N_GPU_LAYERS" not in said   # the flag was given: one line for it, not two
    with pytest.raises(SystemExit):
        parsed("serve", "-hf", "ggml-org/gemma-3-1b-it-GGUF")
    assert "-hf is refused: it downloads from Hugging Face" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parsed("gui", "-ngl", "99")   # the drop-in is serve; the GUI takes none of them


@needs_model
@pytest.mark.skipif(not KVBRIDGE.is_file(), reason=f"no console script {KVBRIDGE}: pip install -e . first")
def test_serve_runs_from_llama_servers_variables_and_its_command_line(tmp_path):
    """As a llama-server compose file would start it: the model, context and port only in LLAMA_ARG_*, and
    llama-server's README flags that mean nothing here on the command line."""
    openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVB_", "XDG_", "LLAMA_ARG_"))}
    env.update(HOME=str(home), LLAMA_ARG_MODEL=str(EMBEDDED_MODEL_PATH), LLAMA_ARG_CTX_SIZE="2048",
               LLAMA_ARG_PORT=str(port), LLAMA_ARG_N_GPU_LAYERS="99", KVB_THREADS="1")
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([str(KVBRIDGE), "serve", "--jinja", "--metrics", "-cb", "--no-webui"],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "KVBridge serve ready on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="x", max_tokens=4, temperature=0,
                                                messages=[{"role": "user", "content": "Say hello."}])
        assert answer.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    said = log_path.read_text()
    assert code == 0, said
    assert f"{EMBEDDED_MODEL_PATH}, context 2048 tokens a request of 2048 shared" in said   # LLAMA_ARG_MODEL, _CTX_SIZE
    for line in ("--jinja is accepted and ignored", "--metrics is accepted and ignored",
                 "LLAMA_ARG_N_GPU_LAYERS is set and ignored"):
        assert line in said, line


def test_batch_sizes_are_kvbridges_own_or_refused_saying_why(capsys, monkeypatch):
    from kvbridge.backends.base import BATCH_TOKENS
    from kvbridge.settings import flags

    assert flags.BATCH_TOKENS == BATCH_TOKENS   # the settings layer's copy of the proven piece
    for argv in (("-b", "2048"), ("-b", "512"), ("--batch-size", "4096"), ("-ub", "512"), ("--ubatch-size", "512")):
        flag_settings("serve", *argv)   # llama-server's defaults and KVBridge's size run as they are
    for argv, said in ((("-b", "1000"), "-b/--batch-size: 1000: the logical batch size takes a multiple of 512"),
                       (("-ub", "2048"), "-ub/--ubatch-size: 2048: the physical batch size takes 512 only"),
                       (("-b", "256"), "cold cut and exact mode are proven")):
        with pytest.raises(SystemExit) as refused:
            parsed("serve", *argv)
        assert refused.value.code == 2 and said in capsys.readouterr().err, argv
    monkeypatch.setenv("LLAMA_ARG_UBATCH", "1024")
    with pytest.raises(SystemExit, match="LLAMA_ARG_UBATCH 1024: the physical batch size takes 512 only"):
        flag_settings("serve")
    monkeypatch.setenv("LLAMA_ARG_UBATCH", "512")
    monkeypatch.setenv("LLAMA_ARG_BATCH", "2048")
    flag_settings("serve")


def test_flash_attn_takes_llama_servers_words_and_auto_is_off(capsys, monkeypatch):
    assert Settings().flash_attn is False
    assert flag_settings("serve", "-fa", "on").flash_attn is True
    assert flag_settings("serve", "--flash-attn", "off").flash_attn is False
    monkeypatch.setenv("KVB_FLASH_ATTN", "true")
    assert flag_settings("serve", "-fa", "auto").flash_attn is False   # auto is off: exact mode needs it off
    monkeypatch.setenv("LLAMA_ARG_FLASH_ATTN", "on")
    assert flag_settings("serve").flash_attn is True and flag_settings("serve", "-fa", "off").flash_attn is False
    assert flag_settings("namespace", "-fa", "on").flash_attn is True   # its namespace is serve's
    with pytest.raises(SystemExit) as refused:
        parsed("serve", "-fa", "maybe")
    assert refused.value.code == 2 and "-fa/--flash-attn: 'maybe' is not on, off or auto" in capsys.readouterr().err
    monkeypatch.setenv("LLAMA_ARG_FLASH_ATTN", "yes please")
    with pytest.raises(SystemExit, match="LLAMA_ARG_FLASH_ATTN: 'yes please' is not on, off or auto"):
        flag_settings("serve")


def test_alias_names_the_model_as_llama_server_takes_them(monkeypatch):
    assert flag_settings("serve", "-a", " my-model , gpt-4o-mini,").serve_model_alias == "my-model,gpt-4o-mini"
    monkeypatch.setenv("LLAMA_ARG_ALIAS", "from-env")
    assert flag_settings("serve").serve_model_alias == "from-env"
    assert flag_settings("serve", "--alias", "given").serve_model_alias == "given"
    assert any("KVB_SERVE_MODEL_ALIAS='two words'" in p for p in Settings(serve_model_alias="two words").validate())
    assert not Settings(serve_model_alias="a,b").validate()


def test_version_prints_kvbridges_and_llama_cpps_and_exits_0():
    import llama_cpp

    done = subprocess.run([sys.executable, "-m", "kvbridge", "serve", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("kvbridge ") and f"llama-cpp-python {llama_cpp.__version__}" in done.stdout


def test_c_is_llama_servers_shared_context_split_only_when_np_is_given(monkeypatch, capsys):
    from kvbridge.backends.gguf_vocab import GGUFVocab

    monkeypatch.setenv("KVB_SCHED_KV_CELLS", "8192")
    s = flag_settings("serve", "-c", "16384")
    assert (s.sched_kv_cells, s.ctx_size) == (16384, 16384)   # no -np: one request may use it all
    s = flag_settings("serve", "-c", "8192", "-np", "4")
    assert (s.sched_kv_cells, s.ctx_size, s.sched_max_running) == (8192, 2048, 4)   # -np given: split
    assert flag_settings("gui", "-c", "4096").sched_kv_cells == 4096                  # the GUI's scheduler alike
    assert flag_settings("namespace", "-c", "4096").sched_kv_cells == 8192            # elsewhere: a request's only
    s = flag_settings("serve", "-m", str(EMBEDDED_MODEL_PATH), "-c", "0")
    meta = GGUFVocab(EMBEDDED_MODEL_PATH).metadata
    trained = int(meta[f"{meta['general.architecture']}.context_length"])
    assert (s.sched_kv_cells, s.ctx_size) == (trained, trained) and trained > 0
    assert f"-c 0 is the model's trained context, {trained} tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as too_small:
        flag_settings("serve", "-c", "100")
    assert "KVB_SCHED_KV_CELLS=100 is too small" in str(too_small.value) and "-c 100" in str(too_small.value)
