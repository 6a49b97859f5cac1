"""Every message the docs quote is one KVBridge can print: the docs are held to the code.

A quoted message is a line of a fenced block tagged `output` in README.md or Docs/*.md:

    ```output
    error: Cannot serve on <host>:<port>: the port is in use … (Address already in use)
    ```

A quoted line holds to ONE string of the code (a Python string literal or f-string, implicitly or
`+` joined, anywhere under kvbridge/ or scripts/, or a "..." string of a shell script there; `{…}`,
`%s`, `$var` are its holes) in one of two ways:
- pieces: its parts that vary written as `…` or `<a name>`, the literal pieces left appear in that order
  in the string, none across a hole;
- whole: one line of the string with its holes filled by example values (`Port 8080 on 127.0.0.1 is
  already in use …`), then only placeholders or punctuation. A hole filled with a sentence (another
  string's text, `{rebuild_advice()}`), or a sentence after the match (`message += ...`), must itself
  hold to the code.
A wrapper's prefix (`error: ` from the CLI's main, `[setup] ERROR: ` from setup) is stripped first, and
each prefix is itself checked. Other programs' words (pip's, Redis's) stand as a placeholder in an
`output` block, or go in a block tagged `text`, which is not checked. Troubleshooting.md, the page of
quoted messages, has no untagged block: each is `bash`, `output` or `text`, so a new quote cannot slip
past this test unmarked.

Left out on purpose: whether the code still reaches the line that prints (tests of each feature do
that), and messages quoted in running text (the docs put what a reader should recognise in a block).
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "Docs").glob("*.md"))]
TAGGED_ONLY = ROOT / "Docs" / "Troubleshooting.md"
SOURCES = [ROOT / "kvbridge", ROOT / "scripts"]
QUOTE_TAG = "output"
# What wraps a message on its way out; each must itself be printed by the code (checked below).
PREFIXES = ("error: ", "[setup] ERROR: ", "[build_llama_server] ERROR: ", "[setup] ", "KV caching refused: ",
            "Cannot start the serve endpoint: ", "cleanup.sh: ")
PLACEHOLDER = re.compile(r"…|<[^<>\n]+>")
REST_OF_LINE = r"(?:…|<[^<>\n]+>|\W)*$"   # what may follow a whole match: placeholders and punctuation
FENCE = re.compile(r"^```(\S*)\s*$")
LONG_FILLING = 6   # plain words in a hole from which on its filling is checked as a message of its own
HOLE = "\x00"   # stands for a string's {…} / %s / $var part, so a doc piece cannot run across it
PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdrfgi]")
FORMAT_FIELD = re.compile(r"\{\w*(?:[!:][^{}]*)?\}")
SHELL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"(?:[ \t]+"(?:[^"\\]|\\.)*")*')   # echo "a" "b" prints "a b"
SHELL_EXPANSION = re.compile(r"\$\((?:[^()]|\([^()]*\))*\)|\$\{[^}]*\}|\$(?:\w+|[*@#?])")


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(tag, line number of the opening fence, the lines inside) for every fenced block."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        opening = FENCE.match(lines[index].strip())
        if not opening:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].strip() == "```"), len(lines))
        blocks.append((opening.group(1), index + 1, lines[index + 1:end]))
        index = end + 1
    return blocks


def quoted_messages() -> list[tuple[str, int, str]]:
    """(page, line number, the line) for every non-empty line of every `output` block."""
    quotes = []
    for page in PAGES:
        for tag, start, lines in fenced_blocks(page.read_text(encoding="utf-8")):
            if tag == QUOTE_TAG:
                quotes += [(page.relative_to(ROOT).as_posix(), start + offset, line.strip())
                           for offset, line in enumerate(lines, start=1) if literal_pieces(line)]
    return quotes


def strip_prefix(line: str) -> str:
    for prefix in PREFIXES:
        if line.startswith(prefix) and line != prefix:
            return line[len(prefix):]
    return line


def literal_pieces(line: str) -> list[str]:
    """The parts of a quoted line that are not placeholders, each stripped; punctuation-only parts dropped."""
    return [piece for piece in (part.strip() for part in PLACEHOLDER.split(line)) if re.search(r"\w", piece)]


def _render(node: ast.AST) -> str | None:
    """A string expression as text, its non-literal parts as HOLE; None for what is not a string."""
    if isinstance(node, ast.Constant):   # "%s", "{port}" are holes too: logging, % and str.format fill them
        return FORMAT_FIELD.sub(HOLE, PERCENT_FIELD.sub(HOLE, node.value)) if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else HOLE for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _render(node.left), _render(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else HOLE) + (right if right is not None else HOLE)
    return None


@lru_cache(maxsize=1)
def code_strings() -> tuple[str, ...]:
    """Every string the code can print from: Python strings under SOURCES, and each shell script line."""
    strings: set[str] = set()
    for folder in SOURCES:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
                text = _render(node)
                if text and len(text) > 3:
                    strings.add(text)
        for path in folder.rglob("*.sh"):
            # a line continued with a backslash is one command, so one string; its "..." strings, expansions as holes
            for line in path.read_text(encoding="utf-8").replace("\\\n", " ").splitlines():
                strings.add(line)
                # (a script's embedded Python has f-strings: their {…} are holes too)
                strings.update(FORMAT_FIELD.sub(HOLE, re.sub(r'"[ \t]+"', " ", quoted[1:-1]))
                               for quoted in SHELL_STRING.findall(SHELL_EXPANSION.sub(HOLE, line)))
    return tuple(strings)


def pieces_in_order(pieces: list[str], text: str) -> bool:
    position = 0
    for piece in pieces:
        found = text.find(piece, position)
        if found < 0:
            return False
        position = found + len(piece)
    return True


@lru_cache(maxsize=1)
def code_templates() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(longest literal run, the literal runs between its holes) for each line of each code string."""
    templates = []
    for text in code_strings():
        for line in text.splitlines():
            runs = line.split(HOLE)
            longest = max(runs, key=len).strip()
            if HOLE in line and len(longest) >= 12:   # a template with little literal text matches anything
                templates.append((longest, tuple(runs)))
    return tuple(templates)


@lru_cache(maxsize=None)
def template_patterns(runs: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """The template with nothing after it but placeholders and punctuation; then with any rest (a message
    another string appends, as `message += ...` does)."""
    body = "(.*?)".join(map(re.escape, runs))
    return re.compile(body + REST_OF_LINE), re.compile(body + "(.*)$")


def is_sentence(text: str) -> bool:
    """Six plain words or more (a path, a list of names or an example value has fewer)."""
    words = " ".join(literal_pieces(text)).split()
    return sum(bool(re.fullmatch(r"\(?[A-Za-z]{2,}[),.;:]*", word)) for word in words) >= LONG_FILLING


def filled_in(line: str) -> bool:
    """The 'whole' way: a code line's template, its holes filled with examples, is the quoted line. A hole
    filled with a sentence (another string's text: `{rebuild_advice()}`), or words after the template, must
    hold to the code too."""
    for longest, runs in code_templates():
        if longest not in line:
            continue
        for pattern in template_patterns(runs):
            match = pattern.match(line)
            if not match or not all(not is_sentence(part) or printed_by_the_code(part) for part in match.groups()):
                continue
            appended = not pattern.pattern.endswith(REST_OF_LINE) and runs[-1]   # the second pattern's rest
            if not appended or printed_by_the_code(match.groups()[-1]):
                return True
    return False


def printed_by_the_code(line: str) -> bool:
    """The line, its wrapper's prefix stripped (or as it stands), holds to the code in one of the two ways."""
    candidates = dict.fromkeys((strip_prefix(line), line))
    return any(pieces_found(candidate) or filled_in(candidate) for candidate in candidates)


def pieces_found(line: str) -> bool:
    """The 'pieces' way: the literal pieces in order in one string."""
    pieces = literal_pieces(line)
    if not pieces:
        return True
    first = max(pieces, key=len)
    return any(pieces_in_order(pieces, text) for text in code_strings() if first in text)


def test_the_docs_quote_messages_at_all():
    # Guards the marking itself: Troubleshooting.md is made of quoted messages.
    assert sum(page == TAGGED_ONLY.relative_to(ROOT).as_posix() for page, _, _ in quoted_messages()) >= 30


def test_troubleshooting_marks_every_block():
    untagged = [start for tag, start, _ in fenced_blocks(TAGGED_ONLY.read_text(encoding="utf-8")) if not tag]
    assert not untagged, (f"Docs/Troubleshooting.md has fenced blocks without a tag at lines {untagged}: tag each "
                          f"```{QUOTE_TAG} (what KVBridge prints: checked against the code), ```text (another "
                          f"program's words: not checked) or ```bash (what to run)")


@pytest.mark.parametrize("prefix", PREFIXES)
def test_every_stripped_prefix_is_printed(prefix):
    last_word = prefix.split()[-1]
    assert any(re.match(".*?".join(map(re.escape, text.split(HOLE))) + "$", prefix + HOLE)
               or text.startswith(prefix) and text != prefix or text.startswith(prefix.rstrip() + " %s")
               for text in code_strings() if last_word in text), f"nothing in the code prints the prefix {prefix!r}"


@pytest.mark.parametrize("page, number, line", quoted_messages(),
                         ids=[f"{page}:{number}" for page, number, _ in quoted_messages()])
def test_every_quoted_message_is_printed_by_the_code(page, number, line):
    assert printed_by_the_code(line), (
        f"{page}:{number} quotes a message no string in kvbridge/ or scripts/ holds (its literal pieces, in "
        f"order, in one string):\n  {line}\nQuote what the code prints now (read the code), writing the parts that "
        f"vary as … or <name>; another program's words go in a ```text block.")


def test_the_rule_on_hand_written_cases():
    assert literal_pieces("Cannot serve on <host>:<port>: the port is in use … (x)") == [
        "Cannot serve on", ": the port is in use", "(x)"]
    assert strip_prefix("error: the cache server cannot listen") == "the cache server cannot listen"
    assert pieces_in_order(["Cannot serve on", "the port is in use"], f"Cannot serve on {HOLE}: the port is in use")
    assert not pieces_in_order(["the port is in use", "Cannot serve on"], f"Cannot serve on {HOLE}: the port is in use")
    assert _render(ast.parse('f"a {b} c" + d').body[0].value) == f"a {HOLE} c{HOLE}"
    port_line = ("Port 8080 on 127.0.0.1 is already in use (KVB_LLAMA_SERVER_PORT); choose another port or 0 for "
                 "any free one.")
    assert printed_by_the_code(port_line)
    assert not printed_by_the_code(port_line.replace("choose another", "pick another"))
