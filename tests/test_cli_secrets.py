"""A command line that never reads one flag as another and never prints a secret (issue 46, item 5), and the systemd
credential decided by the opened file (item 6).

The refusals are driven through the real `python -m kvbridge` in a child process, as a person (or systemd, into
the journal) runs it, with a marker secret in every place a secret can be typed by mistake; the marker must not
appear in anything the process prints. The parser's rules are then checked on every parser of the command table.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cli.commands import build_parser
from kvbridge.errors import BadSettings
from kvbridge.settings import secrets
from kvbridge.settings.cmdline import Parser
from kvbridge.settings.secrets import secret_from_file

MARKER = "sk-marker-5f3a9c1e"            # shaped like a key: what a person pastes
NAME_SHAPED = "sk_marker_5f3a9c1e"       # a key that would pass for a variable's name (letters, digits, _)
REPO = Path(__file__).resolve().parent.parent


def kvbridge(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m kvbridge ARGV` from an empty folder, no KVB_ variable but `env`, an empty settings file, and a
    model file that passes the settings' check (the refusals here all come before any model is read)."""
    empty_env = tmp_path / "empty.env"
    empty_env.write_text("")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    base.update(HOME=str(tmp_path), KVB_ENV_FILE=str(empty_env), KVB_MODEL_PATH=str(model), PYTHONPATH=str(REPO),
                **env)
    return subprocess.run([sys.executable, "-m", "kvbridge", *argv], cwd=tmp_path, env=base, capture_output=True,
                          text=True, timeout=120)


def said(run: subprocess.CompletedProcess) -> str:
    return run.stdout + run.stderr


@pytest.mark.parametrize("argv", [
    ("serve", "--api-key", MARKER),                    # llama-server's flag: once read as --api-key-file
    ("serve", f"--api-key={MARKER}"),
    ("serve", "--api-key", MARKER, "-c", "4096"),
    ("-v", "serve", "--port", "8081", "--api-key", MARKER),
    ("serve", "--api-key", NAME_SHAPED),
])
def test_a_key_given_on_the_command_line_is_refused_by_name_and_never_printed(tmp_path, argv):
    run = kvbridge(tmp_path, *argv)
    assert run.returncode == 2, said(run)
    assert MARKER not in said(run) and NAME_SHAPED not in said(run), said(run)
    assert "--api-key is refused" in run.stderr and "KVB_SERVE_API_KEY_FILE" in run.stderr, run.stderr
    assert "KVB_SERVE_API_KEY_ENV" in run.stderr and "loading" not in run.stdout   # stopped before any model


def test_a_key_before_the_command_is_not_echoed_either(tmp_path):
    run = kvbridge(tmp_path, "--api-key", MARKER, "serve")   # MARKER lands where the command's name goes
    assert run.returncode == 2 and MARKER not in said(run), said(run)
    assert "invalid choice" in run.stderr


def test_n_is_not_read_as_np(tmp_path):
    """llama-server's -n is n_predict; argparse once read it as -np (serve's parallel sequences)."""
    run = kvbridge(tmp_path, "serve", "-n", "32")
    assert run.returncode == 2, said(run)
    assert "-n is refused" in run.stderr and "KVB_SERVE_MAX_TOKENS" in run.stderr, run.stderr
    assert "32" not in run.stderr.split("error:")[-1]   # the words after an unknown flag are never echoed
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "-n", "32"])


@pytest.mark.parametrize("env,names", [
    ({"KVB_SERVE_API_KEY_ENV": MARKER}, "KVB_SERVE_API_KEY_ENV must be the NAME"),
    ({"KVB_SERVE_ADMIN_KEY_ENV": MARKER}, "KVB_SERVE_ADMIN_KEY_ENV must be the NAME"),
    ({"KVB_CACHE_SERVER_TOKEN_ENV": MARKER}, "KVB_CACHE_SERVER_TOKEN_ENV must be the NAME"),
    ({"KVB_CACHE_SERVER_SECRET_KEY_ENV": MARKER}, "KVB_CACHE_SERVER_SECRET_KEY_ENV must be the NAME"),
    ({"KVB_L3_PASSWORD_ENV": MARKER}, "KVB_L3_PASSWORD_ENV must be the NAME"),
    ({"KVB_S3_ACCESS_KEY_ENV": MARKER}, "KVB_S3_ACCESS_KEY_ENV must be the NAME"),
    ({"KVB_S3_SECRET_KEY_ENV": MARKER}, "KVB_S3_SECRET_KEY_ENV must be the NAME"),
    ({"KVB_CACHE_SERVER_PUBLIC_KEY": MARKER}, "KVB_CACHE_SERVER_PUBLIC_KEY is not a Z85 CURVE key"),
    ({"KVB_SERVE_API_KEY_FILE": MARKER}, "KVB_SERVE_API_KEY_FILE names a file that does not exist"),
    ({"KVB_SERVE_API_KEY_FILE": MARKER, "KVB_SERVE_API_KEY_ENV": "SERVE_KEY"}, "keep one of them"),
    ({"KVB_SERVE_API_KEY_ENV": NAME_SHAPED}, "KVB_SERVE_API_KEY_ENV names a variable that is empty or not set"),
])
def test_a_secret_typed_into_a_setting_is_never_printed(tmp_path, env, names):
    run = kvbridge(tmp_path, "-v", "serve", **env)
    assert run.returncode != 0, said(run)
    assert names in said(run) and MARKER not in said(run) and NAME_SHAPED not in said(run), said(run)


def test_a_key_file_typed_as_the_key_is_never_printed(tmp_path):
    """`--api-key-file KEY` (the key where its file goes): refused as a file that does not exist, naming neither."""
    run = kvbridge(tmp_path, "serve", "--api-key-file", MARKER)
    assert run.returncode != 0 and "does not exist" in said(run) and "--api-key-file" in said(run), said(run)
    assert MARKER not in said(run), said(run)


def test_a_variable_shaped_name_and_an_existing_key_file_are_still_named(tmp_path):
    """What the person must fix is still named when it cannot be a secret typed in the wrong place."""
    run = kvbridge(tmp_path, "serve", **{"KVB_SERVE_ADMIN_KEY_ENV": "ADMIN_KEY"})
    assert "KVB_SERVE_ADMIN_KEY_ENV names ADMIN_KEY, but that variable is empty" in said(run), said(run)
    key = tmp_path / "serve.key"
    key.write_text(MARKER)
    key.chmod(0o644)
    run = kvbridge(tmp_path, "serve", "--api-key-file", str(key))
    assert f"chmod 600 {key}" in said(run) and MARKER not in said(run), said(run)


# ---------------------------------------------------------------------------------------------------------------
# the parser, on every parser of the command table


def every_parser():
    top = build_parser()
    yield top
    yield from top._subparsers._group_actions[0].choices.values()


def test_no_spelling_is_read_as_another_in_any_parser():
    """Each proper prefix of each defined spelling (`--api-key` of `--api-key-file`, `-n` of `-np`, `-c` of
    `-ctk`), and each short flag with letters run into it (`-mg`), is refused unless it is itself defined."""
    checked = 0
    for parser in every_parser():
        spellings = set(parser._option_string_actions)
        for spelling in spellings:
            guesses = {spelling[:n] for n in range(2, len(spelling))} | {spelling + "x"}
            for guess in guesses - spellings - {"--"}:
                namespace, extras = parser.parse_known_args([guess])
                assert extras == [guess], (parser.prog, guess, vars(namespace))
                checked += 1
    assert checked > 200


def test_defined_spellings_and_spelling_equals_value_still_work():
    args = build_parser().parse_args(["serve", "-np", "2", "-c=4096", "--port=8081", "-ctk", "f16"])
    assert (args.parallel, args.ctx_size, args.port, args.cache_type_k) == (2, 4096, 8081, "f16")


def test_argparse_own_messages_hide_the_value_of_a_secret_named_flag(capsys):
    parser = Parser(prog="probe")
    parser.add_argument("--token", type=int)
    parser.add_argument("--max-tokens", type=int)
    with pytest.raises(SystemExit):
        parser.parse_args(["--token", MARKER])
    err = capsys.readouterr().err
    assert "argument --token: invalid int value" in err and MARKER not in err
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-tokens", "many"])   # not a secret's name: the value helps, and is shown
    assert "invalid int value: 'many'" in capsys.readouterr().err


def test_every_parser_of_the_project_is_the_exact_one():
    """Every `ArgumentParser(` in kvbridge/ is kvbridge.settings.cmdline.Parser, but the build's smoke decode, run
    by path with no kvbridge import: it has no short flags, so allow_abbrev=False closes every guess there."""
    for path in (REPO / "kvbridge").rglob("*.py"):
        text = path.read_text()
        if "argparse.ArgumentParser(" not in text or path.name == "cmdline.py":
            continue
        assert path.name == "smoke_decode.py" and "allow_abbrev=False" in text, path


# ---------------------------------------------------------------------------------------------------------------
# the systemd credential: decided by the opened file, not by what its name points at afterwards


def test_a_name_swapped_into_the_credentials_directory_after_the_open_is_refused(tmp_path, monkeypatch):
    """Whoever can write the folder a key file's name lies in opens their own file through it, then points the
    name into $CREDENTIALS_DIRECTORY before it is looked at: the file read must still be held to the owner rule."""
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    credential = credentials / "serve-key"
    credential.write_text("the-real-key\n")
    credential.chmod(0o640)                     # systemd's copy: group-readable, trusted in that directory only
    shared = tmp_path / "shared"
    shared.mkdir()
    planted = shared / "planted"
    planted.write_text("planted-key\n")
    planted.chmod(0o644)                        # open to everyone: refused anywhere but in the credentials directory
    name = shared / "serve.key"
    name.symlink_to(credential)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    assert secret_from_file("KVB_SERVE_API_KEY_FILE", str(name)) == "the-real-key"   # through a link: trusted

    name.unlink()
    name.symlink_to(planted)
    real_open = os.open

    def open_then_swap(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if Path(path) == name:
            name.unlink()
            name.symlink_to(credential)
        return fd

    monkeypatch.setattr(secrets.os, "open", open_then_swap)
    with pytest.raises(BadSettings, match="open to others"):
        secret_from_file("KVB_SERVE_API_KEY_FILE", str(name))


# ---------------------------------------------------------------------------------------------------------------
# log lines: the filter kvbridge.__main__ puts on the root logger's handlers


def test_a_log_line_shows_no_secret_named_setting_nor_the_key_it_names(tmp_path, monkeypatch):
    """Through the filter `python -m kvbridge` installs: L3's own warning names the password variable (here a
    password typed where its name goes), and a line that quotes the key a *_ENV setting names is scrubbed too."""
    import io
    import logging

    from kvbridge.settings import Settings
    from kvbridge.settings.redact import hidden_values, hide_in_logs
    from kvbridge.store.redis_tier import RedisTier

    monkeypatch.setenv("KVB_L3_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("KVB_L3_PASSWORD_ENV", NAME_SHAPED)
    monkeypatch.setenv("KVB_SERVE_API_KEY_ENV", "SERVE_KEY")
    monkeypatch.setenv("SERVE_KEY", MARKER)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    settings = Settings.from_env()
    hide_in_logs(hidden_values(settings, os.environ))
    RedisTier.from_settings(settings)
    logging.getLogger("kvbridge.anything").warning("a careless line: %s", MARKER)
    written = stream.getvalue()
    assert "KVB_L3_PASSWORD_ENV names (not shown)" in written and "a careless line: (not shown)" in written, written
    assert NAME_SHAPED not in written and MARKER not in written, written


def test_the_settings_repr_shows_no_secret_typed_into_a_setting():
    """A traceback or a debug line that prints the Settings shows the names, never a misplaced secret."""
    from kvbridge.settings import Settings

    text = repr(Settings(serve_api_key_env=MARKER, l3_password_env="REDIS_PASSWORD", cache_server_public_key=MARKER))
    assert MARKER not in text and "serve_api_key_env=(not shown)" in text
    assert "l3_password_env='REDIS_PASSWORD'" in text and "ctx_size=4096" in text
