"""Settings: parsing from env and .env, validate() messages, presets, and the .env writer."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from dotenv import dotenv_values

from kvbridge import config
from kvbridge.settings import (
    CLOUD_PRESETS, EMBEDDED_MODEL_PATH, SETTING_NAMES, Settings, env_name, format_size,
    parse_size, settings_to_env, update_env_file, url_problem,
)
from kvbridge.errors import BadSettings

SECRET = "sk-proj-TESTSECRETVALUE0123456789abcdef"
needs_embedded_model = pytest.mark.skipif(
    not EMBEDDED_MODEL_PATH.is_file(), reason=f"embedded model {EMBEDDED_MODEL_PATH} missing (run ./scripts/setup.sh)")


def load(tmp_path: Path, env: dict[str, str] | None = None, dotenv: str = "") -> Settings:
    """Settings from an explicit environment and a .env in tmp_path: never the developer's own."""
    path = tmp_path / ".env"
    path.write_text(dotenv, encoding="utf-8")
    return Settings.from_env(env=env or {}, env_file=path)


def problems_of(settings: Settings, environ: dict[str, str] | None = None) -> list[str]:
    return settings.validate(environ={} if environ is None else environ)


def engine_problems(engine_key: str, settings: Settings, environ: dict[str, str] | None = None) -> list[str]:
    """The engine-specific checks validate() runs once KVB_ENGINE resolves to `engine_key` (on its Backend class)."""
    from kvbridge.backends import resolve_engine
    return resolve_engine(engine_key).cls.settings_problems(settings, environ or {})


def registered(key: str) -> bool:
    from kvbridge.settings.engines import known_engine_names
    return key in known_engine_names()


# -- parsing ------------------------------------------------------------------------------------
def test_defaults_when_nothing_is_set(tmp_path):
    settings = load(tmp_path)
    assert settings == Settings()
    assert (settings.engine, settings.chunk_size, settings.host, settings.port) == ("llamacpp", 256, "127.0.0.1", 7860)
    assert settings.resolved_model_path() == EMBEDDED_MODEL_PATH


@needs_embedded_model
def test_defaults_validate_cleanly(tmp_path):
    assert problems_of(load(tmp_path)) == []


def test_every_field_has_a_kvb_variable():
    assert "_problems" not in SETTING_NAMES
    assert env_name("l1_bytes") == "KVB_L1_BYTES"
    assert len({env_name(n) for n in SETTING_NAMES}) == len(SETTING_NAMES)


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("1000000", 1_000_000),
    ("64k", 64 * 1024), ("64KB", 64_000), ("64kib", 64 * 1024), ("1g", 2**30), (" 3 MiB ", 3 * 2**20),
    ("1_000", 1000), ("0", 0), ("2TiB", 2 * 2**40), ("1.5gib", 3 * 2**29), ("10b", 10), ("4Mi", 4 * 2**20),
])
def test_sizes(tmp_path, text, expected):
    assert parse_size(text) == expected
    settings = load(tmp_path, {"KVB_L1_BYTES": text, "KVB_L2_BYTES": text})
    assert (settings.l1_bytes, settings.l2_bytes) == (expected, expected)
    assert not settings._problems


@pytest.mark.parametrize("text", ["lots", "-1", "1.5 parsecs", "GiB", "1e9", "1,000"])
def test_bad_size_keeps_default_and_is_reported(tmp_path, text):
    settings = load(tmp_path, {"KVB_L1_BYTES": text})
    assert settings.l1_bytes == Settings().l1_bytes
    assert f"KVB_L1_BYTES={text!r} is not a size; use a number of bytes or a value like 512MiB or 2GiB" \
        in problems_of(settings)


def test_the_documented_size_message(tmp_path):
    assert "KVB_L1_BYTES='lots' is not a size; use a number of bytes or a value like 512MiB or 2GiB" \
        in problems_of(load(tmp_path, {"KVB_L1_BYTES": "lots"}))


def test_format_size_round_trips():
    for n in (0, 1000, 1024, 3 * 2**29, 2**30, 8 * 2**30, 123_456_789):
        assert parse_size(format_size(n)) == n
    assert format_size(2**30) == "1GiB" and format_size(1000) == "1000"


@pytest.mark.parametrize("text, expected", [
    ("1", True), ("true", True), ("YES", True), ("On", True),
    ("0", False), ("False", False), ("no", False), ("OFF", False),
])
def test_bools(tmp_path, text, expected):
    assert load(tmp_path, {"KVB_L2_ENABLED": text}).l2_enabled is expected
    assert load(tmp_path, {"KVB_FLASH_ATTN": text}).flash_attn is expected


def test_bad_values_become_messages_naming_the_variable(tmp_path):
    settings = load(tmp_path, {
        "KVB_L2_ENABLED": "maybe", "KVB_CTX_SIZE": "big", "KVB_CLOUD_TIMEOUT": "soon", "KVB_LLAMA_START_TIMEOUT": "nan",
    })
    assert (settings.l2_enabled, settings.ctx_size, settings.cloud_timeout) == (True, 4096, 60.0)
    problems = problems_of(settings)
    assert "KVB_L2_ENABLED='maybe' is not a yes/no value; use true/false, yes/no, on/off or 1/0" in problems
    assert "KVB_CTX_SIZE='big' is not a whole number" in problems
    assert any(p.startswith("KVB_CLOUD_TIMEOUT='soon' is not a number") for p in problems)
    assert any(p.startswith("KVB_LLAMA_START_TIMEOUT='nan' is not a number") for p in problems)


def test_numbers_and_strings(tmp_path):
    settings = load(tmp_path, {"KVB_CHUNK_SIZE": "32", "KVB_CLOUD_TIMEOUT": "2.5", "KVB_ENGINE": " llama-server ",
                               "KVB_CTX_SIZE": "", "KVB_OLLAMA_MODEL": "llama3.2"})
    assert (settings.chunk_size, settings.cloud_timeout, settings.engine) == (32, 2.5, "llama-server")
    assert settings.ctx_size == 4096  # empty keeps the default
    assert settings.ollama_model == "llama3.2"


def test_environment_beats_dotenv(tmp_path):
    dotenv = "# comment\nKVB_PORT=1111\nKVB_CHUNK_SIZE=64\nOTHER_THING=1\n"
    settings = load(tmp_path, {"KVB_PORT": "2222"}, dotenv)
    assert settings.port == 2222       # the environment wins
    assert settings.chunk_size == 64   # .env fills what the environment leaves out


def test_reads_os_environ_by_default_and_never_writes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVB_CHUNK_SIZE", "48")
    monkeypatch.delenv("KVB_PORT", raising=False)
    (tmp_path / ".env").write_text("KVB_PORT=3333\nKVB_CHUNK_SIZE=64\n", encoding="utf-8")
    settings = Settings.from_env(env_file=tmp_path / ".env")
    assert (settings.chunk_size, settings.port) == (48, 3333)
    assert "KVB_PORT" not in os.environ


def test_home_is_expanded_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = load(tmp_path, {"KVB_L2_DIR": "~/l2", "KVB_MODEL_PATH": "~/m.gguf"})
    assert settings.l2_dir == str(tmp_path / "l2")
    assert settings.resolved_model_path() == tmp_path / "m.gguf"


def test_misspelt_variable_gets_a_suggestion(tmp_path):
    settings = load(tmp_path, {"KVB_TEST_L3_PASSWORD": "x"}, "KVB_L1_BYTE=1GiB\nKVB_SOMETHING_ELSE=1\n")
    problems = problems_of(settings)
    assert "KVB_L1_BYTE is not a KVBridge setting; did you mean KVB_L1_BYTES?" in problems   # a typo blocks
    assert not any("KVB_SOMETHING_ELSE" in p for p in problems)
    # a name far from every setting, in .env or the environment, is a warning: named, with the closest one if any
    far, near = settings.warnings()   # sorted by name
    assert far.startswith("KVB_SOMETHING_ELSE is not a KVBridge setting and is ignored") and "Docs/Settings.md" in far
    assert near.startswith("KVB_TEST_L3_PASSWORD is not") and "the closest one is KVB_L3_PASSWORD_ENV" in near


def test_a_variable_a_setting_names_and_the_build_variables_are_not_unknown(tmp_path):
    """KVB_TEST_CS_TOKEN holds a secret once KVB_CACHE_SERVER_TOKEN_ENV names it; KVB_BUILD_JOBS is the build's."""
    settings = load(tmp_path, {"KVB_CACHE_SERVER_TOKEN_ENV": "KVB_TEST_CS_TOKEN", "KVB_TEST_CS_TOKEN": "s3cret",
                               "KVB_BUILD_JOBS": "2", "KVB_SMOKE_CRASH_VARIANTS": ""},
                    "KVB_L3_PASSWORD_ENV=KVB_TEST_REDIS_PASSWORD\nKVB_TEST_REDIS_PASSWORD=pw\n")
    assert settings.warnings() == [] and not any("not a KVBridge setting" in p for p in problems_of(settings))


def test_the_cli_says_an_unknown_name_once_on_stderr_and_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    (tmp_path / ".env").write_text("")
    done = subprocess.run([sys.executable, "-m", "kvbridge", "scenarios"], capture_output=True, text=True, timeout=120,
                          env={**env, "KVB_ENV_FILE": str(tmp_path / ".env"), "KVB_NOT_A_THING": "1"})
    assert done.returncode == 0 and "doc-qa" in done.stdout, done.stderr
    assert done.stderr.count("warning: KVB_NOT_A_THING is not a KVBridge setting") == 1, done.stderr


def test_missing_explicit_env_file_is_reported(tmp_path):
    settings = Settings.from_env(env={}, env_file=tmp_path / "nope.env")
    assert settings == Settings()
    assert any(str(tmp_path / "nope.env") in p and "does not exist" in p for p in problems_of(settings))


def test_problems_do_not_affect_equality_or_repr_and_replace_drops_fixed_ones(tmp_path):
    settings = load(tmp_path, {"KVB_L1_BYTES": "lots", "KVB_PORT": "x"})
    assert settings == Settings() and "_problems" not in repr(settings)
    fixed = settings.replace(l1_bytes=2**20)
    assert fixed.l1_bytes == 2**20
    assert not any("KVB_L1_BYTES" in p for p in problems_of(fixed))
    assert any("KVB_PORT" in p for p in problems_of(fixed))


# -- validate() ---------------------------------------------------------------------------------
def test_unknown_engine_lists_the_registered_ones():
    from kvbridge.settings.engines import known_engine_names
    problems = problems_of(Settings(engine="warp-drive"))
    message = next(p for p in problems if "warp-drive" in p)
    assert "KVB_ENGINE" in message
    for name in known_engine_names():
        assert name in message


def test_validate_degrades_when_an_engine_adapter_does_not_import():
    # A broken adapter module (e.g. one being written) must give a message, not a traceback.
    code = ("import sys; sys.modules['kvbridge.backends.llamacpp'] = None\n"
            "from kvbridge.config import Settings\n"
            "print('\\n'.join(Settings(engine='llamacpp', port=0).validate()))")
    run = subprocess.run([sys.executable, "-c", code], cwd=config.WORK_DIR, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "KVB_ENGINE='llamacpp' is not available: the engine adapters did not all import" in run.stdout
    assert "KVB_PORT=0 is not a port" in run.stdout  # the other problems are still there


@needs_embedded_model
def test_engine_aliases_are_accepted():
    from kvbridge.backends import engine_specs
    for spec in engine_specs():
        for name in (spec.key, *spec.aliases):
            assert not any("KVB_ENGINE" in p for p in problems_of(Settings(engine=name))), name


@pytest.mark.parametrize("changes, expected", [
    ({"chunk_size": 0}, "KVB_CHUNK_SIZE=0 must be at least 1"),
    ({"ctx_size": 32, "chunk_size": 16}, "KVB_CTX_SIZE=32 is too small"),
    ({"ctx_size": 128, "chunk_size": 256}, "KVB_CTX_SIZE=128 is too small"),
    ({"port": 0}, "KVB_PORT=0 is not a port"),
    ({"port": 70000}, "KVB_PORT=70000 is not a port"),
    ({"llama_server_port": -1}, "KVB_LLAMA_SERVER_PORT=-1 is not a port"),
    ({"cloud_token_budget": -5}, "KVB_CLOUD_TOKEN_BUDGET=-5 cannot be negative"),
    ({"threads": -2}, "KVB_THREADS=-2 cannot be negative"),
    ({"n_predict": 0}, "KVB_N_PREDICT=0 must be at least 1"),
    ({"cloud_max_retries": -1}, "KVB_CLOUD_MAX_RETRIES=-1 cannot be negative"),
    ({"cache_type_k": "f8"}, "KVB_CACHE_TYPE_K='f8' is not a KV cache type"),
    ({"host": ""}, "KVB_HOST is empty"),
])
def test_value_problems(changes, expected):
    problems = problems_of(Settings(**changes))
    assert any(p.startswith(expected) for p in problems), problems


@needs_embedded_model
def test_all_interfaces_host_is_allowed():
    assert problems_of(Settings(host="0.0.0.0")) == []


@pytest.mark.parametrize("field", ["ollama_url", "cloud_base_url", "llama_server_url"])
@pytest.mark.parametrize("url", ["ftp://example.com", "localhost:11434", "http://", "http://h:99999",
                                 "http://h:0", "http://user:pw@h:1", "http://h /v1", "http://h:1/?q=1"])
def test_bad_urls_name_the_variable(field, url):
    problems = problems_of(Settings(**{field: url}))
    assert any(p.startswith(env_name(field)) for p in problems), problems
    assert not any("pw@" in p for p in problems if "user" in url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:11434", "https://api.openai.com/v1", "http://[::1]:8080/v1",
                                 "http://localhost:8080/"])
def test_good_urls(url):
    assert url_problem("KVB_X", url) is None


def test_missing_model_file_is_named(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    problems = problems_of(Settings(model_path=str(missing)))
    assert any(str(missing) in p and "KVB_MODEL_PATH" in p and "does not exist" in p for p in problems)
    problems = problems_of(Settings(model_path=str(tmp_path)))
    assert any("is a directory" in p for p in problems)


def test_missing_embedded_model_says_to_run_setup(tmp_path, monkeypatch):
    from kvbridge.settings import models

    monkeypatch.setattr(models, "MODELS_DIR", tmp_path / "absent")   # every embedded model's path is under it
    problems = problems_of(Settings(model="gemma3-270m"))
    assert any("./scripts/setup.sh --model gemma3-270m" in p and "absent" in p and "KVB_MODEL" in p
               for p in problems), problems
    # the llamacpp engine can take an Ollama model's GGUF instead
    assert not engine_problems("llamacpp", Settings(ollama_model="llama3.2"))


def test_llama_server_checks(tmp_path):
    not_executable = tmp_path / "llama-server"
    not_executable.write_text("#!/bin/sh\n")
    problems = engine_problems("llama-server", Settings(llama_server_bin=str(not_executable)))
    assert any("KVB_LLAMA_SERVER_BIN" in p and str(not_executable) in p for p in problems)
    not_executable.chmod(0o755)
    assert not any("KVB_LLAMA_SERVER_BIN" in p
                   for p in engine_problems("llama-server", Settings(llama_server_bin=str(not_executable))))
    attached = Settings(llama_server_url="http://127.0.0.1:8080", model_path=str(tmp_path / "nope.gguf"))
    assert engine_problems("llama-server", attached) == []  # a running server has its own model


def test_ollama_checks():
    problems = engine_problems("ollama", Settings(ollama_model="", ollama_keep_alive="soon"))
    assert any(p.startswith("KVB_OLLAMA_MODEL is empty") for p in problems)
    assert any(p.startswith("KVB_OLLAMA_KEEP_ALIVE='soon'") for p in problems)
    for keep_alive in ("5m", "1h30m", "0", "-1", "300"):
        assert engine_problems("ollama", Settings(ollama_model="llama3.2", ollama_keep_alive=keep_alive)) == []


# -- cloud ----------------------------------------------------------------------------------------
def test_presets_are_complete_data():
    assert set(CLOUD_PRESETS) == {"openai", "groq", "openrouter", "together", "mistral", "deepseek",
                                  "vllm", "lmstudio", "ollama-local-openai"}
    for key, preset in CLOUD_PRESETS.items():
        assert preset.key == key and preset.label
        assert url_problem("base_url", preset.base_url) is None
    for local in ("vllm", "lmstudio", "ollama-local-openai"):
        assert CLOUD_PRESETS[local].key_env == "" and CLOUD_PRESETS[local].base_url.startswith("http://127.0.0.1:")
    assert CLOUD_PRESETS["openai"].key_env == "OPENAI_API_KEY"


def test_cloud_endpoint_explicit_wins():
    assert Settings(cloud_provider="openai").cloud_endpoint() == ("https://api.openai.com/v1", "OPENAI_API_KEY")
    assert Settings(cloud_provider="groq", cloud_base_url="http://127.0.0.1:9/v1/", cloud_api_key_env="MY_KEY") \
        .cloud_endpoint() == ("http://127.0.0.1:9/v1", "MY_KEY")
    assert Settings(cloud_base_url="http://127.0.0.1:8080/v1").cloud_endpoint() == ("http://127.0.0.1:8080/v1", "")
    assert Settings(cloud_provider="deepseek").resolved_cloud_model() == "deepseek-chat"
    assert Settings(cloud_provider="deepseek", cloud_model="x").resolved_cloud_model() == "x"


def test_cloud_needs_a_provider_or_base_url():
    problems = engine_problems("cloud", Settings(cloud_model="m"))
    assert any("KVB_CLOUD_PROVIDER" in p and "KVB_CLOUD_BASE_URL" in p for p in problems)


def test_unknown_provider_lists_presets():
    problems = engine_problems("cloud", Settings(cloud_provider="acme", cloud_model="m"))
    message = next(p for p in problems if "acme" in p)
    assert all(key in message for key in CLOUD_PRESETS)


def test_cloud_model_is_required_unless_the_preset_has_one():
    assert any(p.startswith("KVB_CLOUD_MODEL is empty")
               for p in engine_problems("cloud", Settings(cloud_base_url="http://127.0.0.1:8080/v1")))
    vllm = Settings(cloud_provider="vllm")
    assert any(p.startswith("KVB_CLOUD_MODEL is empty") for p in engine_problems("cloud", vllm))
    assert engine_problems("cloud", Settings(cloud_base_url="http://127.0.0.1:8080/v1", cloud_model="smollm2")) == []


def test_missing_key_variable_is_named_and_the_key_never_printed():
    settings = Settings(cloud_provider="openai", cloud_api_key_env="OPENAI_API_KEY")
    problems = engine_problems("cloud", settings, {})
    expected = "KVB_CLOUD_API_KEY_ENV names OPENAI_API_KEY but that variable is not set"
    assert any(p.startswith(expected) for p in problems)
    assert engine_problems("cloud", settings, {"OPENAI_API_KEY": SECRET}) == []
    # the preset's default variable is checked too
    problems = engine_problems("cloud", Settings(cloud_provider="groq"), {})
    assert any("GROQ_API_KEY" in p and "not set" in p for p in problems)
    # local presets need no key
    assert engine_problems("cloud", Settings(cloud_provider="lmstudio", cloud_model="m"), {}) == []


def test_a_key_pasted_into_the_name_setting_is_refused_without_echo():
    problems = engine_problems("cloud", Settings(cloud_provider="openai", cloud_api_key_env=SECRET), {})
    assert any("NAME of an environment variable" in p for p in problems)
    assert not any(SECRET in p for p in problems)


@pytest.mark.parametrize("headers, ok", [
    ('{"X-Title": "kvbridge", "HTTP-Referer": "http://localhost"}', True),
    ("", True), ("not json", False), ("[1, 2]", False), ('{"X-Count": 1}', False),
])
def test_extra_headers_must_be_a_json_object_of_strings(headers, ok):
    settings = Settings(cloud_base_url="http://127.0.0.1:8080/v1", cloud_model="m", cloud_extra_headers=headers)
    problems = engine_problems("cloud", settings)
    assert (problems == []) is ok, problems
    if not ok:
        assert problems[0].startswith("KVB_CLOUD_EXTRA_HEADERS is not a JSON object of strings")


def test_extra_headers_with_a_token_are_refused_without_echo():
    settings = Settings(cloud_base_url="http://127.0.0.1:8080/v1", cloud_model="m",
                        cloud_extra_headers=f'{{"Authorization": "Bearer {SECRET}"}}')
    problems = engine_problems("cloud", settings)
    assert problems and not any(SECRET in p for p in problems)


@pytest.mark.skipif(not registered("cloud"), reason="the cloud engine is not registered in kvbridge.backends yet")
def test_validate_runs_the_cloud_checks_for_the_cloud_engine():
    problems = problems_of(Settings(engine="cloud", cloud_provider="openai", cloud_api_key_env="OPENAI_API_KEY"))
    assert any(p.startswith("KVB_CLOUD_API_KEY_ENV names OPENAI_API_KEY") for p in problems)
    assert problems_of(Settings(engine="cloud", cloud_base_url="http://127.0.0.1:8080/v1", cloud_model="m")) == []


# -- update_env_file ----------------------------------------------------------------------------
ORIGINAL = """\
# KVBridge settings
KVB_ENGINE=llamacpp

# the store
KVB_L1_BYTES=1GiB   # RAM tier
export KVB_PORT=7860
OTHER_TOOL_SETTING="keep me"
KVB_CHUNK_SIZE='256'
KVB_OLLAMA_MODEL=
KVB_CLOUD_MODEL="old model"  # quoted, with a comment
# KVB_PORT=1234 commented out stays as it is
"""


def test_update_keeps_comments_order_and_other_keys(tmp_path):
    path = tmp_path / ".env"
    path.write_text(ORIGINAL, encoding="utf-8")
    update_env_file(path, {"KVB_L1_BYTES": "512MiB", "KVB_PORT": "8000", "KVB_CHUNK_SIZE": "32",
                           "KVB_OLLAMA_MODEL": "llama3.2", "KVB_CLOUD_MODEL": "new model"})
    assert path.read_text(encoding="utf-8") == ORIGINAL \
        .replace("KVB_L1_BYTES=1GiB   # RAM tier", "KVB_L1_BYTES=512MiB   # RAM tier") \
        .replace("export KVB_PORT=7860", "export KVB_PORT=8000") \
        .replace("KVB_CHUNK_SIZE='256'", "KVB_CHUNK_SIZE=32") \
        .replace("KVB_OLLAMA_MODEL=\n", "KVB_OLLAMA_MODEL=llama3.2\n") \
        .replace('KVB_CLOUD_MODEL="old model"  #', "KVB_CLOUD_MODEL='new model'  #")
    settings = Settings.from_env(env={}, env_file=path)
    assert (settings.l1_bytes, settings.port, settings.chunk_size) == (512 * 2**20, 8000, 32)
    assert (settings.ollama_model, settings.cloud_model) == ("llama3.2", "new model")
    assert dotenv_values(path)["OTHER_TOOL_SETTING"] == "keep me"


def test_update_appends_new_keys_and_creates_the_file(tmp_path):
    path = tmp_path / "sub" / ".env"
    update_env_file(path, {"KVB_ENGINE": "cloud"})
    assert path.read_text() == "KVB_ENGINE=cloud\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("KVB_ENGINE=cloud")  # no final newline
    update_env_file(path, {"KVB_CLOUD_PROVIDER": "openai", "KVB_CLOUD_API_KEY_ENV": "OPENAI_API_KEY",
                           "KVB_CLOUD_TOKEN_BUDGET": "100000"})
    assert path.read_text() == ("KVB_ENGINE=cloud\nKVB_CLOUD_PROVIDER=openai\nKVB_CLOUD_API_KEY_ENV=OPENAI_API_KEY\n"
                                "KVB_CLOUD_TOKEN_BUDGET=100000\n")
    assert [p.name for p in path.parent.iterdir()] == [".env"]  # no temp file left behind


@pytest.mark.parametrize("value", [
    '{"X-Title": "kv bridge", "HTTP-Referer": "http://localhost"}', "/path with spaces/model.gguf",
    "it's", "back\\slash", "a#b", "x # not a comment", "$HOME", "", "plain-value_1.2",
])
def test_quoting_round_trips_through_python_dotenv(tmp_path, value):
    path = tmp_path / ".env"
    update_env_file(path, {"KVB_CLOUD_EXTRA_HEADERS": value})
    assert dotenv_values(path)["KVB_CLOUD_EXTRA_HEADERS"] == value


@pytest.mark.parametrize("changes", [
    {"OPENAI_API_KEY": SECRET},
    {"KVB_OPENAI_API_KEY": "anything"},
    {"KVB_CLOUD_KEY": "x"},
    {"KVB_HF_TOKEN": "x"},
    {"KVB_CLOUD_SECRET": "x"},
    {"KVB_CLOUD_API_KEY_ENV": SECRET},
    {"KVB_CLOUD_MODEL": "gsk_abcdefghijklmnop123"},
    {"KVB_CLOUD_EXTRA_HEADERS": '{"Authorization": "Bearer abc"}'},
    {"KVB_CLOUD_BASE_URL": f"http://127.0.0.1:1/v1?key={SECRET}"},
    {"PATH": "/usr/bin"},
    {"KVB_ENGINE": "two\nlines"},
])
def test_update_refuses_key_values_and_leaves_the_file_alone(tmp_path, changes):
    path = tmp_path / ".env"
    path.write_text(ORIGINAL, encoding="utf-8")
    with pytest.raises(BadSettings) as refused:
        update_env_file(path, {"KVB_PORT": "9999", **changes})
    assert SECRET not in str(refused.value)
    assert path.read_text(encoding="utf-8") == ORIGINAL


def test_settings_to_env_round_trips_through_a_file(tmp_path):
    changed = Settings(engine="cloud", cloud_provider="openai", cloud_api_key_env="OPENAI_API_KEY", l1_bytes=3 * 2**29,
                       l2_enabled=False, cloud_timeout=2.5, chunk_size=32, cloud_extra_headers='{"X-Title": "kv"}')
    as_env = settings_to_env(changed)
    assert set(as_env) == {env_name(n) for n in SETTING_NAMES}
    assert as_env["KVB_L1_BYTES"] == "1536MiB" and as_env["KVB_L2_ENABLED"] == "false"
    assert Settings.from_env(env=as_env, env_file=tmp_path / ".env-absent").replace() == changed
    path = tmp_path / ".env"
    update_env_file(path, settings_to_env(changed, only_changed=True))
    assert Settings.from_env(env={}, env_file=path) == changed
    assert len(path.read_text().splitlines()) == 8


# -- .env.example -------------------------------------------------------------------------------
ENV_EXAMPLE = config.WORK_DIR / ".env.example"


def test_env_example_documents_every_setting_with_its_default():
    values = dotenv_values(ENV_EXAMPLE)
    lines = ENV_EXAMPLE.read_text(encoding="utf-8").splitlines()
    for name in SETTING_NAMES:
        var = env_name(name)
        assert var in values, f"{var} is not in .env.example"
        first = next(i for i, line in enumerate(lines) if line.startswith(var + "="))
        assert any(lines[i].startswith("# ") for i in range(max(0, first - 2), first)), f"{var} has no comment"
    settings = Settings.from_env(env={}, env_file=ENV_EXAMPLE)
    assert settings == Settings() and not settings._problems


def example_block(title: str) -> str:
    """One commented-out example block of .env.example, uncommented."""
    block = ENV_EXAMPLE.read_text(encoding="utf-8").split(f"# -- {title}")[1].split("# -- ")[0]
    return "\n".join(line[2:] for line in block.splitlines() if line.startswith("# KVB_"))


@pytest.mark.parametrize("title, engine", [
    ("1. Local llama.cpp", "llamacpp"), ("2. llama-server", "llama-server"), ("3. Ollama", "ollama"),
    ("4. Hosted provider", "cloud"), ("5. Free cloud-path smoke test", "cloud"),
])
def test_env_example_blocks_parse_and_pass_their_engine_checks(tmp_path, title, engine):
    text = ENV_EXAMPLE.read_text(encoding="utf-8") + "\n" + example_block(title) + "\n"
    settings = load(tmp_path, {}, text)
    assert settings.engine == engine and not settings._problems
    if engine in ("ollama", "cloud"):
        assert engine_problems(engine, settings, {"OPENAI_API_KEY": SECRET}) == []


def test_env_example_names_every_kvb_variable_the_code_or_scripts_read():
    import re
    root = config.WORK_DIR
    example = ENV_EXAMPLE.read_text(encoding="utf-8")
    sources = [*(root / "kvbridge").rglob("*.py"), *(root / "scripts").glob("*.sh"), *(root / "scripts").glob("*.py")]
    names = {name for path in sources for name in re.findall(r"KVB_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8"))}
    assert names and sorted(n for n in names if n not in example) == []
