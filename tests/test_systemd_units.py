"""The example systemd units in deploy/systemd/ are valid units whose command lines KVBridge accepts.

`systemd-analyze verify` reads each unit as systemd would (unknown keys, bad values, an ExecStart binary
that does not exist): the units name /opt/kvbridge/bin/kvbridge, where Docs/Deploy.md installs KVBridge,
so they are rendered with this checkout's own `kvbridge` command into a temporary folder first. Each
ExecStart is parsed by KVBridge's real argument parser, and the units are held to each other: loopback
only, serve's key file is the credential the unit loads, serve's store is the cache server's address,
and both find the cache server's token where the cache server writes it.

Left out on purpose: starting the units (that needs systemd as PID 1 and root, neither of which a test
here has); what the services do once started is what tests/test_serve*.py and test_cache_server*.py test.
"""
from __future__ import annotations

import configparser
import dataclasses
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cli.commands import build_parser
from kvbridge.settings import Settings
from kvbridge.settings.core import env_name

ROOT = Path(__file__).resolve().parent.parent
UNIT_DIR = ROOT / "deploy" / "systemd"
UNITS = sorted(UNIT_DIR.glob("*.service"))
INSTALLED_COMMAND = "/opt/kvbridge/bin/kvbridge"   # where Docs/Deploy.md installs it
CACHE_SERVER, SERVE = "kvbridge-cache-server.service", "kvbridge-serve.service"


def service(name: str) -> dict[str, list[str]]:
    """The [Service] section of a unit: key -> every value it is given (systemd keys repeat)."""
    values: dict[str, list[str]] = {}
    section = ""
    for line in (UNIT_DIR / name).read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


def environment(name: str) -> dict[str, str]:
    return dict(item.split("=", 1) for value in service(name).get("Environment", []) for item in shlex.split(value))


def exec_start(name: str, credentials: str = "/run/credentials/x") -> list[str]:
    (line,) = service(name)["ExecStart"]
    return shlex.split(line.replace("${CREDENTIALS_DIRECTORY}", credentials))


def test_the_units_are_there():
    assert {unit.name for unit in UNITS} == {CACHE_SERVER, SERVE}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian: apt-get install systemd)")
def test_systemd_analyze_verifies_every_unit(tmp_path):
    command = Path(sys.executable).with_name("kvbridge")
    assert command.is_file(), f"{command} is missing: run ./scripts/setup.sh (it installs the kvbridge command)"
    for unit in UNITS:
        text = unit.read_text()
        assert INSTALLED_COMMAND in text, f"{unit.name} does not run {INSTALLED_COMMAND}"
        (tmp_path / unit.name).write_text(text.replace(INSTALLED_COMMAND, str(command)))
    # together: serve Requires= the cache server, which verify must find
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", *sorted(map(str, tmp_path.glob("*.service")))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


@pytest.mark.parametrize("unit, command", [(CACHE_SERVER, "cache-server"), (SERVE, "serve")])
def test_exec_start_parses_with_kvbridge_own_parser(unit, command):
    argv = exec_start(unit)
    assert argv[0] == INSTALLED_COMMAND and argv[1] == command, argv
    args = build_parser().parse_args(argv[1:])   # argparse exits (SystemExit) on a flag it does not know
    assert args.command == command


def test_both_listen_on_loopback_and_serve_uses_the_cache_server():
    cache_server = build_parser().parse_args(exec_start(CACHE_SERVER)[1:])
    serve = build_parser().parse_args(exec_start(SERVE)[1:])
    assert cache_server.host == "127.0.0.1" and serve.host == "127.0.0.1"
    assert environment(SERVE)["KVB_STORE_URL"] == f"tcp://127.0.0.1:{cache_server.port}"


def test_serve_reads_its_key_from_the_credential_the_unit_loads():
    (credential,) = service(SERVE)["LoadCredential"]
    name, _, source = credential.partition(":")
    assert source.startswith("/etc/kvbridge/")
    args = build_parser().parse_args(exec_start(SERVE, credentials="/run/credentials/kvbridge-serve.service")[1:])
    assert args.api_key_file == f"/run/credentials/kvbridge-serve.service/{name}"


def test_both_find_the_token_where_the_cache_server_writes_it():
    # token_dir() is $XDG_CACHE_HOME/kvbridge/run: the cache server's runtime directory, one account for both
    runtime = service(CACHE_SERVER)["RuntimeDirectory"][0]
    assert environment(CACHE_SERVER)["XDG_CACHE_HOME"] == environment(SERVE)["XDG_CACHE_HOME"] == f"/run/{runtime}"
    assert service(CACHE_SERVER)["User"] == service(SERVE)["User"] == ["kvbridge"]
    assert (UNIT_DIR / "kvbridge.sysusers.conf").read_text().count("\nu kvbridge ") == 1   # the account, made
    assert service(CACHE_SERVER)["RuntimeDirectoryMode"] == ["0700"]


def test_hardening_keeps_the_hosts_shared_memory():
    for unit in (CACHE_SERVER, SERVE):
        options = service(unit)
        assert options["ProtectSystem"] == ["strict"] and options["NoNewPrivileges"] == ["yes"]
        assert "/dev/shm" in " ".join(options.get("ReadWritePaths", []))
        # a private /dev has its own /dev/shm, and RemoveIPC= deletes a running server's pool
        assert "PrivateDevices" not in options and "RemoveIPC" not in options and "DynamicUser" not in options


def test_every_kvb_variable_the_units_set_is_a_setting():
    for unit in (CACHE_SERVER, SERVE):
        kvb = {key: value for key, value in environment(unit).items() if key.startswith("KVB_")}
        assert kvb, unit
        unknown = set(kvb) - {env_name(field.name) for field in dataclasses.fields(Settings)}
        assert not unknown, f"{unit} sets {sorted(unknown)}, which no Settings field reads"


def test_the_units_parse_as_ini():
    # systemd's syntax is close enough to INI that a repeated key is the only difference configparser minds
    for unit in UNITS:
        configparser.ConfigParser(strict=False, interpolation=None).read_string(unit.read_text())
