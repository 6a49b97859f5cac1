"""The command-line flags that mirror llama-server's: one table, each flag with the Settings field it sets in
each command that takes it (`serve`, `gui`, `cache-server`).

Place in the flow: argv -> argparse (options built from FLAGS by kvbridge.cli.common) -> Settings.from_env()
-> `.replace(**overrides(...))` -> validate(). A flag is only ever an override of one Settings field (its
KVB_ variable), so it wins over the environment and `.env`, and validate() checks its value as it checks the
variable's; `blame()` then names the flag in the messages it caused. kvbridge.settings.reference renders
FLAGS into Docs/Settings.md, which is why the table lives in the settings layer and not in kvbridge.cli.

Decisions, where llama-server's meaning needed one here:
- `-m` takes a GGUF path (KVB_MODEL_PATH, made absolute); an embedded model's name (`-m smollm2-135m`) with no
  file of that name selects that model instead (KVB_MODEL, and KVB_MODEL_PATH emptied). In `serve`, whose
  engines are all llama.cpp, `-m` also sets aside KVB_OLLAMA_MODEL (which else comes before KVB_MODEL).
- `-c N` in serve and gui means what llama-server's does: the KV every request shares, N cells
  (KVB_SCHED_KV_CELLS), and what one request may use (KVB_CTX_SIZE): all N, or N split across the slots when `-np`
  is given (llama-server splits only then; context_changes). `-c 0` is the model's trained context, read from the
  GGUF by kvbridge.cli.common (the settings layer reads no model). Elsewhere `-c` is KVB_CTX_SIZE alone, and
  KVB_CTX_SIZE/KVB_SCHED_KV_CELLS set by variables keep their own meanings (serve says at start when a request
  could use more than every request shares).
- `-np` is the number of sequences decoding at once: the scheduler's KVB_SCHED_MAX_RUNNING (in `gui`, the
  lab tab's scheduler and `gui --serve`'s).
- `explain`, `namespace`, `bench` and `demo` take serve's model, K/V, context and thread flags (and `explain`
  and `namespace` its `--exact`), so that given serve's flags they compute serve's namespace.
- `cache-server` takes `--host`/`--port` only: together they make KVB_CACHE_SERVER_URL tcp://HOST:PORT (the
  one given keeps the other's part of that URL); `--url` stays, and is refused beside them. It runs no model.
- serve is the drop-in for llama-server: where a flag is not given it reads llama-server's variable for it
  (`LLAMA_ARG_*`, from_llama_env), and it accepts and ignores, with a line at start, the llama-server flags that
  mean nothing here (IGNORED: -ngl, -cb, --metrics, --jinja, ...). Docs/Serve.md's "Coming from llama-server"
  table is llama_server_table().
- `-fa on|off|auto` sets KVB_FLASH_ATTN (kind "onoff"): auto is off, since exact mode and the proven cold cut need
  the transposed V that flash attention gives up (llama-server's auto turns it on where the device supports it).
- `-b`/`-ub` (BATCHES): KVBridge prefills in pieces of BATCH_TOKENS (512) from position 0, and the cold cut and
  exact mode are proven on those pieces. `-ub` (the physical batch, what llama.cpp computes at once) takes 512
  only; `-b` (the logical batch, split by llama.cpp into ubatches) takes any multiple of 512, llama-server's
  default 2048 among them, since its pieces are then the same 512-token ones. No KVB_ setting: one value works.
- `-a/--alias` sets KVB_SERVE_MODEL_ALIAS: comma-separated names, as llama-server takes them; the first is the id
  /v1/models, /props and every answer show.
- `LLAMA_API_KEY` (llama-server's key variable, comma-separated keys) is read by serve as llama-server reads it,
  the one variable of llama-server's that holds a secret: serve stores only its NAME, as KVB_SERVE_API_KEY_ENV
  (from_llama_env), so the key is read at start and never stored, shown or passed on.
Deliberately left out: llama-server flags whose meaning differs here (-n, --slots). A flag not
in the table is refused by name (kvbridge.settings.cmdline: no spelling is read as another); REFUSED says why
and what to use instead for the llama-server flags a person is likeliest to bring, its secrets first.
"""
from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvbridge.settings.core import Settings, env_name
from kvbridge.settings.models import DEFAULT_MODEL, EMBEDDED_MODELS
from kvbridge.settings.redact import shown

SERVE, GUI, CACHE_SERVER = "serve", "gui", "cache-server"
EXPLAIN, NAMESPACE, BENCH, DEMO = "explain", "namespace", "bench", "demo"
# the commands that only look at (or run) the model serve runs: given the same model, K/V and mode flags, they
# compute the namespace serve's KV is stored under (`kvbridge explain -m X -ctk q8_0` after `serve -m X -ctk q8_0`)
MODEL_COMMANDS = (EXPLAIN, NAMESPACE, BENCH, DEMO)
COMMANDS = (SERVE, GUI, CACHE_SERVER, *MODEL_COMMANDS)


def _model(field: str, mode: bool = False) -> dict[str, str]:
    """A flag's field in serve and gui, and in the commands that look at serve's model (the mode flag only
    where a namespace is shown: CachedEngine, which bench and demo run, is exact by its cold cut)."""
    return {SERVE: field, GUI: field, **{c: field for c in (MODEL_COMMANDS[:2] if mode else MODEL_COMMANDS)}}


@dataclass(frozen=True)
class Flag:
    """One flag: its spellings (llama-server's first), the field it sets per command, and what it means."""

    spellings: tuple[str, ...]
    fields: Mapping[str, str]      # command -> the Settings field the flag sets there
    metavar: str
    help: str                      # the same in every command that takes it
    kind: str = "text"             # text, int, path (made absolute, `~` expanded), switch (--x: on, --no-x: off) or
    #                                onoff (llama-server's on|off|auto as a bool; auto: off, see the module docstring)
    unset: str = ""                # what an unset field means, when its default value does not say it
    env: str = ""                  # llama-server's variable for it (LLAMA_ARG_*), read by serve as llama-server reads it

    @property
    def dest(self) -> str:
        """The argparse attribute: the long spelling without dashes (--ctx-size -> ctx_size)."""
        return self.spellings[-1].lstrip("-").replace("-", "_")

    @property
    def name(self) -> str:
        return "/".join(self.spellings)


FLAGS: tuple[Flag, ...] = (
    Flag(("-m", "--model"), _model("model_path"), "PATH",
         f"the GGUF model file to load, or an embedded model's name ({', '.join(EMBEDDED_MODELS)}), which sets "
         "KVB_MODEL instead", kind="path", unset=f"the embedded model KVB_MODEL names, {DEFAULT_MODEL}",
         env="LLAMA_ARG_MODEL"),
    Flag(("-c", "--ctx-size"), _model("ctx_size"), "N",
         "context size, as llama-server's: the KV every request shares (also KVB_SCHED_KV_CELLS in serve and gui), "
         "all of it one request's, or split across the slots when -np is given; 0: the model's trained context",
         kind="int", env="LLAMA_ARG_CTX_SIZE"),
    Flag(("-t", "--threads"), _model("threads"), "N", "CPU threads for the model; 0: every core",
         kind="int", env="LLAMA_ARG_THREADS"),
    Flag(("-np", "--parallel"), {SERVE: "sched_max_running", GUI: "sched_max_running"}, "N",
         "sequences decoding at once (the scheduler's continuous batch; 1 to 64)", kind="int",
         env="LLAMA_ARG_N_PARALLEL"),
    Flag(("--host",), {SERVE: "serve_host", GUI: "host", CACHE_SERVER: "cache_server_url"}, "HOST",
         "address to listen on; beyond 127.0.0.1 only on purpose", env="LLAMA_ARG_HOST"),
    Flag(("--port",), {SERVE: "serve_port", GUI: "port", CACHE_SERVER: "cache_server_url"}, "PORT",
         "port to listen on", kind="int", env="LLAMA_ARG_PORT"),
    Flag(("-ctk", "--cache-type-k"), _model("cache_type_k"), "TYPE",
         "KV cache type for K: f16, f32, bf16, q8_0, q4_0, ... (part of the cache's namespace)",
         env="LLAMA_ARG_CACHE_TYPE_K"),
    Flag(("-ctv", "--cache-type-v"), _model("cache_type_v"), "TYPE",
         "KV cache type for V (a quantised one needs flash attention, KVB_FLASH_ATTN)",
         env="LLAMA_ARG_CACHE_TYPE_V"),
    Flag(("-fa", "--flash-attn"), _model("flash_attn"), "on|off|auto",
         "flash attention; auto is off here, since exact mode needs it off (on changes the V layout and so the "
         "cache's namespace)", kind="onoff", env="LLAMA_ARG_FLASH_ATTN"),
    Flag(("-a", "--alias"), {SERVE: "serve_model_alias"}, "NAMES",
         "the model's names in the API, comma-separated: the first is the id /v1/models and every answer show",
         unset="the model file's name", env="LLAMA_ARG_ALIAS"),
    Flag(("--api-key-file",), {SERVE: "serve_api_key_file"}, "PATH",
         "a file you own, readable by you alone (chmod 600), holding the bearer tokens clients may send, one a line "
         "(# lines are comments), as llama-server's; read once at start, never shown; not with KVB_SERVE_API_KEY_ENV", kind="path", unset="no key"),
    Flag(("--exact",), _model("sched_exact", mode=True), "",
         "every answer equals the same request run alone, however many run at once (KVBridge's own; off by itself, "
         "said at start, with KVB_FLASH_ATTN=true or a recurrent model); --no-exact turns it off", kind="switch"),
)


_KEY_INSTEAD = ("put the key in a file of yours (chmod 600) and give --api-key-file PATH (KVB_SERVE_API_KEY_FILE), "
                "or name a variable that holds it in KVB_SERVE_API_KEY_ENV")

# llama-server flags refused by name: spelling -> why, and what to use instead (never the value given)
REFUSED: Mapping[str, str] = {
    "--api-key": "a key on the command line can be read by every local account (ps, /proc); " + _KEY_INSTEAD,
    "--ssl-key-file": "serve speaks plain HTTP; put TLS in a proxy in front of it (its private key stays there)",
    "--ssl-cert-file": "serve speaks plain HTTP; put TLS in a proxy in front of it",
    "-hft": "KVBridge takes no Hugging Face token; fetch the model first and give -m PATH",
    "--hf-token": "KVBridge takes no Hugging Face token; fetch the model first and give -m PATH",
    "-hf": "it downloads from Hugging Face, and KVBridge runs offline: download the GGUF and give -m PATH",
    "-hfr": "it downloads from Hugging Face, and KVBridge runs offline: download the GGUF and give -m PATH",
    "--hf-repo": "it downloads from Hugging Face, and KVBridge runs offline: download the GGUF and give -m PATH",
    "-n": "it is llama-server's --n-predict; in serve a request's max_tokens decides, at most KVB_SERVE_MAX_TOKENS",
    "--n-predict": "in serve a request's max_tokens decides, at most KVB_SERVE_MAX_TOKENS",
}


@dataclass(frozen=True)
class Ignored:
    """A llama-server flag serve accepts and ignores, saying why at start: it means nothing here, and refusing it
    would stop a llama-server command line that runs as it is (its value, if it takes one, is read and dropped)."""

    spellings: tuple[str, ...]
    takes_value: bool
    why: str
    env: str = ""   # llama-server's variable for it: set, it is ignored the same way

    @property
    def dest(self) -> str:
        return "ignored_" + self.spellings[-1].lstrip("-").replace("-", "_")


IGNORED: tuple[Ignored, ...] = (
    Ignored(("-ngl", "--gpu-layers", "--n-gpu-layers"), True,
            "KVBridge runs llama.cpp on the CPU: no layer goes to a GPU", "LLAMA_ARG_N_GPU_LAYERS"),
    Ignored(("-cb", "--cont-batching"), False, "serve's scheduler always batches continuously",
            "LLAMA_ARG_CONT_BATCHING"),
    Ignored(("-nocb", "--no-cont-batching"), False, "serve's scheduler always batches continuously"),
    Ignored(("--metrics",), False, "serve's /metrics is always on (the operator's, Prometheus text)"),
    Ignored(("--jinja",), False, "serve renders every prompt with the model's own chat template; requests with "
            "`tools` are refused with a 400", "LLAMA_ARG_JINJA"),
    Ignored(("--no-jinja",), False, "serve renders every prompt with the model's own chat template"),
    Ignored(("--no-webui",), False, "serve has no web UI (KVBridge's GUI is `kvbridge gui`)"),
    Ignored(("--no-warmup",), False, "serve's start-up evaluates only the few tokens its layout probe needs"),
    Ignored(("--slot-save-path",), True, "serve keeps KV in KVBridge's store (KVB_L2_DIR and the tiers below it), "
            "not in slot files"),
    Ignored(("-cram", "--cache-ram"), True, "KVBridge's RAM tier is KVB_L1_BYTES; llama-server's RAM prompt cache "
            "is what it replaces", "LLAMA_ARG_CACHE_RAM"),
)


ON, OFF, AUTO = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0"), ("auto",)   # llama-server's words


def flag_value(flag: Flag, text: str, source: str = ""):
    """A flag's value from its text (the command line's, or its LLAMA_ARG_* variable's, `source`): an int, an
    onoff's bool, else the text; ValueError naming what it takes."""
    if flag.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{source or flag.name}: invalid int value: {text!r}") from None
    if flag.kind == "onoff":
        word = text.strip().lower()
        if word in ON or word in OFF + AUTO:
            return word in ON
        raise ValueError(f"{source or flag.name}: {_not_on_off(text)}")
    return text


# kvbridge.backends.base.BATCH_TOKENS, the prefill piece the cold cut and exact mode are proven on (the settings
# layer sits below the backends, so it is repeated here; tests/test_cli_flags.py holds the two equal)
BATCH_TOKENS = 512


def argparse_type(flag: Flag):
    """What argparse converts the flag's text with: int, an onoff's bool (its error naming the words it takes), str."""
    if flag.kind == "int":
        return int
    if flag.kind != "onoff":
        return str

    def on_off(text: str) -> bool:
        try:
            return flag_value(flag, text)
        except ValueError:
            raise argparse.ArgumentTypeError(_not_on_off(text)) from None
    return on_off


def _not_on_off(text: str) -> str:
    return f"{text!r} is not on, off or auto (auto is off here: exact mode needs flash attention off)"


@dataclass(frozen=True)
class Batch:
    """A llama-server batch flag serve takes only at the size KVBridge's cut and exact mode are proven on."""

    spellings: tuple[str, ...]
    env: str
    what: str          # what the size is, in llama-server's words
    multiple: bool     # any multiple of BATCH_TOKENS (the logical batch), or BATCH_TOKENS only (the physical one)

    @property
    def dest(self) -> str:
        return self.spellings[-1].lstrip("-").replace("-", "_")

    def why(self) -> str:
        if self.multiple:
            return (f"takes a multiple of {BATCH_TOKENS} (llama-server's default 2048 among them): llama.cpp splits "
                    f"a logical batch into {BATCH_TOKENS}-token ubatches, the pieces KVBridge's cold cut and exact "
                    "mode are proven on")
        return (f"takes {BATCH_TOKENS} only: KVBridge prefills in {BATCH_TOKENS}-token pieces from position 0, and "
                "its cold cut and exact mode are proven on them")

    def argparse_type(self, text: str) -> int:
        try:
            return self.check(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: the {self.what} {self.why()}") from None

    def check(self, text: str, source: str = "") -> int:
        """The size, or ValueError naming the flag (or its variable), why, and what works."""
        value = int(text) if text.strip().isdigit() else -1
        if value == BATCH_TOKENS or (self.multiple and value > 0 and value % BATCH_TOKENS == 0):
            return value
        raise ValueError(f"{source or '/'.join(self.spellings)} {text}: the {self.what} {self.why()}")


BATCHES: tuple[Batch, ...] = (
    Batch(("-b", "--batch-size"), "LLAMA_ARG_BATCH", "logical batch size", multiple=True),
    Batch(("-ub", "--ubatch-size"), "LLAMA_ARG_UBATCH", "physical batch size", multiple=False),
)


def batches_for(command: str) -> tuple[Batch, ...]:
    """The batch flags `command` takes (serve's, as the drop-in for llama-server)."""
    return BATCHES if command == SERVE else ()


def ignored_for(command: str) -> tuple[Ignored, ...]:
    """The llama-server flags `command` accepts and ignores (serve's, as the drop-in for llama-server)."""
    return IGNORED if command == SERVE else ()


def from_llama_env(command: str, given: Mapping[str, object], environ: Mapping[str, str]) -> dict[str, object]:
    """`given` with each flag not on the command line taken from llama-server's variable for it (LLAMA_ARG_*), as
    llama-server reads them: serve only (what llama-server's Docker images and compose files set). The
    command line wins over them, and they over KVB_ variables, as a flag does."""
    if command != SERVE:
        return dict(given)
    taken = dict(given)
    for flag in flags_for(command):
        if flag.env and taken.get(flag.dest) is None and environ.get(flag.env, "").strip():
            try:
                taken[flag.dest] = flag_value(flag, environ[flag.env].strip(), flag.env)
            except ValueError as exc:
                raise SystemExit(f"Settings need attention:\n  - {exc}") from None
    for batch in BATCHES:
        if taken.get(batch.dest) is None and environ.get(batch.env, "").strip():
            try:
                batch.check(environ[batch.env].strip(), batch.env)
            except ValueError as exc:
                raise SystemExit(f"Settings need attention:\n  - {exc}") from None
    if environ.get(LLAMA_API_KEY, "").strip() and taken.get("api_key_file") is None:
        taken[LLAMA_KEY_DEST] = LLAMA_API_KEY   # its NAME, as KVB_SERVE_API_KEY_ENV: the key is read at start only
    return taken


LLAMA_API_KEY = "LLAMA_API_KEY"   # llama-server's key variable: comma-separated keys (kvbridge.serve.server reads it)
LLAMA_KEY_DEST = "llama_api_key_env"


def ignored_lines(command: str, given: Mapping[str, object], environ: Mapping[str, str]) -> list[str]:
    """One line per llama-server flag (or its variable) given to `command` that it ignores, saying why."""
    lines = []
    for flag in ignored_for(command):
        if given.get(flag.dest) not in (None, False):
            lines.append(f"{flag.spellings[0]} is accepted and ignored: {flag.why}")
        elif flag.env and environ.get(flag.env, "").strip():
            lines.append(f"{flag.env} is set and ignored: {flag.why}")
    return lines


def flags_for(command: str) -> tuple[Flag, ...]:
    """The flags `command` takes, in the table's order."""
    return tuple(flag for flag in FLAGS if command in flag.fields)


def default_text(flag: Flag, command: str) -> str:
    """The field's built-in default, as a person reads it (for --help and the reference page)."""
    field = flag.fields[command]
    value = getattr(Settings(), field)
    if field == "cache_server_url":
        host, port = _tcp_parts(value) or ("127.0.0.1", 5555)
        return host if flag.dest == "host" else str(port)
    return flag.unset if flag.unset and value in ("", 0) else str(value)


def help_text(flag: Flag, command: str) -> str:
    """What `kvbridge COMMAND --help` says of the flag: its meaning, its KVB_ variable, its default."""
    field = flag.fields[command]
    if field == "cache_server_url":
        where = "with the other of --host/--port sets KVB_CACHE_SERVER_URL=tcp://HOST:PORT; not with --url"
        return f"{flag.help} [{where}; default {default_text(flag, command)}]"
    return f"{flag.help} [{env_name(field)}; default {default_text(flag, command)}]"


# ---------------------------------------------------------------------------------------------
# parsed flags -> Settings changes


def overrides(command: str, given: Mapping[str, object], settings: Settings) -> dict[str, object]:
    """The Settings changes the flags given to `command` ask for (a flag whose value is None was not given).
    `settings`: what the environment and `.env` say, for cache-server's URL the flags change a part of."""
    changes: dict[str, object] = {}
    for flag in flags_for(command):
        value = given.get(flag.dest)
        field = flag.fields[command]
        if value is None or field == "cache_server_url":
            continue
        if flag.dest == "model":
            changes.update(model_changes(command, str(value)))
        elif flag.dest == "ctx_size" and command in SHARED_CONTEXT:
            changes.update(context_changes(int(value), given.get("parallel")))
        elif flag.dest == "alias":
            changes[field] = ",".join(name.strip() for name in str(value).split(",") if name.strip())
        elif flag.kind == "path":
            changes[field] = absolute(str(value))
        else:
            changes[field] = value
    if command == SERVE and given.get(LLAMA_KEY_DEST):
        changes["serve_api_key_env"] = given[LLAMA_KEY_DEST]
    if command == CACHE_SERVER and (given.get("host") is not None or given.get("port") is not None):
        changes["cache_server_url"] = tcp_url(settings.cache_server_url, given.get("host"), given.get("port"))
    return changes


SHARED_CONTEXT = (SERVE, GUI)   # the commands whose -c is llama-server's: the KV shared by every request


def context_changes(n_ctx: int, parallel: object) -> dict[str, object]:
    """-c N as llama-server reads it: N KV cells shared by every request (KVB_SCHED_KV_CELLS), each request's most
    all N (KVB_CTX_SIZE), or N split across the slots when -np is given. N is the model's trained context for
    -c 0, resolved before this (kvbridge.cli.common)."""
    slots = int(parallel) if isinstance(parallel, int) and parallel > 0 else 1
    return {"sched_kv_cells": n_ctx, "ctx_size": n_ctx // slots}


def model_changes(command: str, text: str) -> dict[str, object]:
    """-m: a path (KVB_MODEL_PATH) or, when no such file exists, an embedded model's name (KVB_MODEL)."""
    if text in EMBEDDED_MODELS and not Path(text).expanduser().exists():
        changes: dict[str, object] = {"model": text, "model_path": ""}
    else:
        changes = {"model_path": absolute(text)}
    if command != GUI:   # serve's engines are all llama.cpp: the flag, not KVB_OLLAMA_MODEL, names the model
        changes["ollama_model"] = ""
    return changes


def absolute(path: str) -> str:
    """A path as given on the command line (relative to the current folder, maybe with `~`), made absolute."""
    return os.path.abspath(os.path.expanduser(path))


def _tcp_parts(url: str) -> tuple[str, int] | None:
    scheme, _, rest = url.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not colon or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def tcp_url(current: str, host: object, port: object) -> str:
    """cache-server's --host/--port as tcp://HOST:PORT; the one not given keeps its part of `current`
    (KVB_CACHE_SERVER_URL), or of the default when that is no tcp:// URL."""
    current_host, current_port = _tcp_parts(current) or _tcp_parts(Settings().cache_server_url) or ("127.0.0.1", 5555)
    host = str(host) if host is not None else current_host
    port = port if port is not None else current_port
    return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"


def blame(command: str, given: Mapping[str, object], problems: list[str]) -> tuple[list[str], list[str]]:
    """(the problems a flag given to `command` caused, each naming the flag and its value, a secret's never; the
    others).
    A problem is the flag's when it names the KVB_ variable the flag set."""
    named = []
    for flag in flags_for(command):
        value = given.get(flag.dest)
        if value is not None:
            fields = ("model_path", "model") if flag.dest == "model" else (flag.fields[command],)
            if flag.dest == "ctx_size" and command in SHARED_CONTEXT:
                fields = ("ctx_size", "sched_kv_cells")
            named.append((f"{flag.spellings[0]} {shown(flag.spellings[-1], value)}", [env_name(f) for f in fields]))
    flagged, others = [], []
    for problem in problems:
        by = [spelled for spelled, variables in named if any(re.search(rf"\b{v}\b", problem) for v in variables)]
        if by:
            flagged.append(f"{problem} (given on the command line: {', '.join(by)})")
        else:
            others.append(problem)
    return flagged, others


def llama_server_table() -> str:
    """Docs/Serve.md's "Coming from llama-server" table: each llama-server flag serve knows, what it does in
    serve, and llama-server's variable for it (tests/test_cli_flags.py holds the page to this)."""
    rows = ["| llama-server flag | in `kvbridge serve` | variable |", "| --- | --- | --- |"]
    for flag in flags_for(SERVE):
        if flag.spellings[0].startswith("--") and flag.dest in ("api_key_file", "exact"):
            continue   # KVBridge's own, not llama-server's
        rows.append(f"| `{', '.join(flag.spellings)}` | sets `{env_name(flag.fields[SERVE])}`: {flag.help} | "
                    f"{f'`{flag.env}`' if flag.env else '—'} |")
    for batch in BATCHES:
        rows.append(f"| `{', '.join(batch.spellings)}` | accepted at KVBridge's size, else refused: the {batch.what} "
                    f"{batch.why()} | `{batch.env}` |")
    for ignored in IGNORED:
        rows.append(f"| `{', '.join(ignored.spellings)}` | accepted and ignored, said at start: {ignored.why} | "
                    f"{f'`{ignored.env}` (ignored)' if ignored.env else '—'} |")
    for spelling, why in REFUSED.items():
        variable = "—"
        if spelling == "--api-key":   # the flag is refused, its variable read: it is never seen by other accounts
            variable = (f"`{LLAMA_API_KEY}`, read as llama-server reads it: comma-separated keys, any of which a "
                        "client may send as `Authorization: Bearer KEY`, each the `default` tenant's; only the "
                        "variable's name is kept (as `KVB_SERVE_API_KEY_ENV`)")
        rows.append(f"| `{spelling}` | refused: {why} | {variable} |")
    return "\n".join(rows)
