"""The settings reference, Docs/Settings.md: generated from `Settings` and the comments in `.env.example`.

For people, beside the run's own flow (environment + `.env` -> Settings -> validate()). Each setting's
name, type and default come from the dataclass, so the page cannot drift from the code; its meaning
is the comment above it in `.env.example`, the one place a person writes it; the page's sections are
that file's `# ---- ... ----` headings. The few KVB_ variables the build scripts read that are not
settings are listed once, in BUILD_TIME below. Deliberately left out: the reader's own environment
and `.env` (the page is the same on every machine, and no secret's value can reach it).

    python -m kvbridge.settings.reference           print the page
    python -m kvbridge.settings.reference --write   write Docs/Settings.md
    python -m kvbridge.settings.reference --check   exit 1 when Docs/Settings.md is not what --write would write
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_type_hints

from kvbridge.settings.cmdline import Parser
from kvbridge.settings.core import PATH_FIELDS, SIZE_FIELDS, Settings, env_name, settings_to_env
from kvbridge.settings.flags import COMMANDS, FLAGS, MODEL_COMMANDS, default_text
from kvbridge.settings.paths import WORK_DIR

SOURCE_ROOT = Path(__file__).resolve().parents[2]   # a source checkout: .env.example and Docs/ are not in a wheel
ENV_EXAMPLE = SOURCE_ROOT / ".env.example"
REFERENCE_PAGE = SOURCE_ROOT / "Docs" / "Settings.md"
REGENERATE = ".venv/bin/python -m kvbridge.settings.reference --write"


@dataclass(frozen=True)
class BuildVariable:
    """A KVB_ variable read outside Settings (by the build scripts): Settings.from_env ignores it."""

    name: str
    read_by: str
    meaning: str


# The one list of KVB_ variables that are not Settings fields. tests/test_settings_reference.py fails
# when scripts/ or kvbridge/ name a KVB_ variable that is neither a field nor listed here.
BUILD_TIME = (
    BuildVariable(
        "KVB_LLAMA_CMAKE_ARGS",
        "scripts/build_variants.py (environment, else .env), run by scripts/setup.sh; "
        "scripts/build_llama_server.sh builds with the flags it recorded in .venv/kvbridge-build.json",
        "cmake flags for llama.cpp, e.g. -DGGML_NATIVE=ON. Set, they replace the build ladder (claimed, no-amx, "
        "avx2) for llama-cpp-python and llama-server alike; a change rebuilds both at the next ./scripts/setup.sh "
        "and ./scripts/build_llama_server.sh. Empty: the ladder, first rung whose smoke decode runs."),
    BuildVariable(
        "KVB_BUILD_JOBS",
        "scripts/build_variants.py (environment, else .env), for the llama-cpp-python build of scripts/setup.sh "
        "and the llama-server build of scripts/build_llama_server.sh",
        "Parallel compile jobs for every llama.cpp build (CMAKE_BUILD_PARALLEL_LEVEL, cmake --build -j); "
        "a whole number of 1 or more. Empty: every core."),
    BuildVariable(
        "KVB_BUILD_VARIANT",
        "set by scripts/build_variants.py in the environment of each llama-cpp-python build",
        "The name of the rung being built (claimed, no-amx, avx2, native, or custom for KVB_LLAMA_CMAKE_ARGS), "
        "for the build log and a test's --build-command. Set by the build; never set it yourself."),
    BuildVariable(
        "KVB_SMOKE_CRASH_VARIANTS",
        "kvbridge/backends/smoke_decode.py (the smoke decode after each build and before the first in-process "
        "load); kvbridge/backends/build_check.py (part of a checked build's identity)",
        "Test hook only: a comma-separated list of variants (e.g. claimed,no-amx) whose smoke decode dies by "
        "SIGILL, to test the ladder's fallback and the GUI's crash message on a CPU that runs everything. "
        "Never set it otherwise."),
    BuildVariable(
        "KVB_ENV_FILE",
        "kvbridge/settings/core.py (Settings.from_env, from the environment only)",
        "The settings file to read instead of the default one: a checkout's own .env, or for an installed "
        "package ~/.config/kvbridge/.env ($XDG_CONFIG_HOME). An installed package never reads the current "
        "folder's .env, whose settings could name a binary to run. A file named here that is missing is reported."),
)

# KVB_ words in the code that are no variable at all.
NOT_VARIABLES = {"KVB_SEP": "the text of KVB_BLEND_SEPARATOR's default, [KVB_SEP]"}


# ---------------------------------------------------------------------------------------------
# .env.example: its sections, and the comment above each variable

_HEADING = re.compile(r"^# -{3,} (?P<title>.+?) -{3,}$")
_ASSIGNMENT = re.compile(r"^(?P<name>KVB_[A-Z0-9_]+)=")
_EXAMPLES = "# ====="   # the commented-out example blocks below it repeat variables described above


@dataclass
class Section:
    title: str
    meanings: dict[str, str] = field(default_factory=dict)   # variable -> its comment, in file order


@dataclass
class EnvExample:
    preamble: list[str]
    sections: list[Section]

    def meaning(self, name: str) -> str | None:
        """The comment above `name`; None when the file does not set it."""
        return next((s.meanings[name] for s in self.sections if name in s.meanings), None)


def read_env_example(text: str) -> EnvExample:
    """Sections and meanings. A variable's meaning is the comment block right above it (empty when there is
    none: the tests ask for one). A comment followed by a blank line, such as a note on a commented-out
    variable, belongs to no variable."""
    preamble: list[str] = []
    sections: list[Section] = []
    comment: list[str] = []
    for line in text.splitlines():
        if line.startswith(_EXAMPLES):
            break
        heading = _HEADING.match(line)
        assignment = _ASSIGNMENT.match(line)
        if heading:
            sections.append(Section(heading["title"]))
            comment = []
        elif line.startswith("#"):
            comment.append(line[1:].rstrip())
        elif assignment and sections:
            sections[-1].meanings[assignment["name"]] = " ".join(part.strip() for part in comment)
            comment = []
        else:   # a blank line (or text outside any section)
            if not sections:
                preamble += comment
            comment = []
    return EnvExample([line.removeprefix(" ") for line in preamble], sections)


# ---------------------------------------------------------------------------------------------
# one setting: its type and default as the page shows them


def type_label(name: str) -> str:
    """The kind of text the variable takes, in a reader's words."""
    kind = get_type_hints(Settings)[name]
    if name.endswith("_env"):
        return "variable name (secret)"
    if name in SIZE_FIELDS:
        return "size"
    if name in PATH_FIELDS:
        return "path"
    return {bool: "yes/no", int: "integer", float: "number", str: "text"}[kind]


def machine_independent(text: str) -> str:
    """A default as .env spells it, the same on every machine: a path in the work folder
    (kvbridge.settings.paths: the checkout) becomes <project>/..., one in the home folder ~/..."""
    home = os.path.expanduser("~").rstrip("/")
    for prefix, shown in ((str(WORK_DIR), "<project>"), (home, "~")):
        if prefix and (text == prefix or text.startswith(prefix + "/")):
            return shown + text[len(prefix):]
    return text


# ---------------------------------------------------------------------------------------------
# Markdown

_CODE_OR_NAME = re.compile(r"(`[^`]*`|KVB_[A-Z0-9_]*[A-Z0-9])")


def _inline(text: str, names: set[str]) -> str:
    """Plain text for a table cell: variable names as code, Markdown's own characters escaped."""
    out = []
    for piece in _CODE_OR_NAME.split(text):
        if piece.startswith("`"):
            out.append(piece.replace("|", "\\|"))
        elif piece in names:
            out.append(f"`{piece}`")
        else:
            out.append(piece.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*")
                       .replace("<", "&lt;").replace(">", "&gt;"))
    return "".join(out)


def _code(value: str) -> str:
    escaped = value.replace("|", "\\|")   # a table cell ends at a bare |, even inside code
    return f"`{escaped}`" if value else "(empty)"


def _anchor(title: str) -> str:
    """GitHub's heading anchor."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _preamble(lines: list[str], names: set[str]) -> list[str]:
    """The file's opening notes as a list; an indented line (a command) joins the item above as code."""
    items: list[str] = []
    for line in lines:
        if line.startswith(" ") and items:
            items[-1] += f" `{line.strip()}`"
        elif line.strip():
            items.append(_inline(line.strip(), names))
    return [f"- {item}" for item in items]


FLAGS_TITLE = "Command-line flags (as llama-server's)"


def flags_table(names: set[str]) -> list[str]:
    """kvbridge.settings.flags.FLAGS as a table: per command, the KVB_ variable each flag sets and its default."""
    columns = [command for command in COMMANDS if command not in MODEL_COMMANDS]
    lines = ["`kvbridge serve`, `gui` and `cache-server` take these flags where llama-server's meaning holds "
             "(`kvbridge serve -m model.gguf -c 4096 -np 4 --port 8080`). Each sets the `KVB_` variable its cell "
             "names and wins over the environment and `.env`; a value the setting would refuse is refused "
             "naming the flag. `--help` of each command lists them. The table is kvbridge/settings/flags.py.",
             "", f"{', '.join(f'`{c}`' for c in MODEL_COMMANDS)} take serve's model, K/V, context and thread flags "
             "(`explain` and `namespace` also `--exact`), as serve reads them: given serve's flags they compute "
             "the namespace serve's KV is stored under.",
             "", "| Flag | " + " | ".join(f"`{c}`" for c in columns) + " | Meaning |",
             "| --- |" + " --- |" * (len(columns) + 1)]
    for flag in FLAGS:
        cells = []
        for command in columns:
            field = flag.fields.get(command)
            if field is None:
                cells.append("—")
            elif field == "cache_server_url":
                default = _code(default_text(flag, command))
                cells.append(f"`KVB_CACHE_SERVER_URL` as tcp://HOST:PORT, default {default}; not with `--url`")
            else:
                cells.append(f"`{env_name(field)}`, default {_inline(default_text(flag, command), names)}")
        spelled = ", ".join(f"`{spelling}`" for spelling in flag.spellings)
        lines.append(f"| {spelled} | {' | '.join(cells)} | {_inline(flag.help, names)} |")
    return lines


def generate() -> str:
    """The whole page."""
    example = read_env_example(ENV_EXAMPLE.read_text(encoding="utf-8"))
    defaults = settings_to_env(Settings())   # {variable: default as .env spells it}, in field order
    names = {*defaults, *(b.name for b in BUILD_TIME)}
    sections = [(s.title, [v for v in s.meanings if v in defaults]) for s in example.sections]
    missing = [v for v in defaults if example.meaning(v) is None]
    if missing:   # tests/test_settings_reference.py fails on these; the page still lists them
        sections.append(("Not yet described in .env.example", missing))
    sections = [(title, variables) for title, variables in sections if variables]
    build_title = "Build-time variables (not settings)"

    lines = [
        "# Settings reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from kvbridge/settings/core.py (names, types, defaults), "
        ".env.example (meanings, sections) and kvbridge/settings/flags.py (the flags). Edit those, not this page. -->",
        "",
        "Every KVBridge setting is one `KVB_` variable, read once into `Settings` (kvbridge/settings/core.py) "
        "from the environment and `.env` (the source checkout's; for an installed package ~/.config/kvbridge/.env, "
        "never the current directory's; KVB_ENV_FILE names another file); the environment wins. A value that does not parse keeps its default and is "
        "reported by the GUI and the CLI. From `.env.example`:",
        "",
        *_preamble(example.preamble, names),
        "",
        "Types: **text**; **integer**; **number** (decimals allowed); **yes/no**; **size** (bytes, or 512MiB, "
        "2GiB, 1.5GB, 64k); **path** (may start with `~`); **variable name (secret)**: the NAME of another "
        "environment variable that holds a key, token or password. The secret itself goes in that variable, "
        "never in `.env`; this page is made from the defaults, never from your environment, so it shows none.",
        "",
        "## Contents",
        "",
        *[f"- [{title}](#{_anchor(title)})" for title, _ in sections],
        f"- [{FLAGS_TITLE}](#{_anchor(FLAGS_TITLE)})",
        f"- [{build_title}](#{_anchor(build_title)})",
    ]
    for title, variables in sections:
        lines += ["", f"## {title}", "", "| Variable | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
        for var in variables:
            name = var.removeprefix("KVB_").lower()
            lines.append(f"| `{var}` | {type_label(name)} | {_code(machine_independent(defaults[var]))} | "
                         f"{_inline(example.meaning(var) or '', names)} |")
    lines += ["", f"## {FLAGS_TITLE}", "", *flags_table(names)]
    lines += ["", f"## {build_title}", "",
              "Read by the build scripts, not by `Settings` (which ignores them); set them in the environment of "
              "the script, or in `.env` where the table says so.", "",
              "| Variable | Read by | Meaning |", "| --- | --- | --- |"]
    lines += [f"| `{b.name}` | {_inline(b.read_by, names)} | {_inline(b.meaning, names)} |" for b in BUILD_TIME]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description="Docs/Settings.md from Settings and .env.example.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write Docs/Settings.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when the committed page is out of date")
    args = parser.parse_args(argv)
    page = generate()
    if args.write:
        REFERENCE_PAGE.write_text(page, encoding="utf-8")
        print(f"wrote {REFERENCE_PAGE}")
    elif args.check:
        current = REFERENCE_PAGE.read_text(encoding="utf-8") if REFERENCE_PAGE.is_file() else ""
        if current != page:
            print(f"{REFERENCE_PAGE} is out of date with Settings and .env.example; regenerate it: {REGENERATE}",
                  file=sys.stderr)
            return 1
        print(f"{REFERENCE_PAGE} is up to date")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
