"""The chat template is rendered in one place: every local renderer gives the same text and token ids.

Contracts: the in-process engine, llama-server (real, on loopback) and the vocab-only GGUF loader
render equal messages to equal text and equal token ids; BOS appears once even when the template
writes it and the tokenizer adds it too; a template that raises is counted and falls back to ChatML.

The embedded SmolLM2 neither adds BOS nor writes it in its template, so the BOS case runs on a copy
of it whose metadata says otherwise (the weights are untouched; see with_metadata below), the way
Llama-3-style GGUFs are configured.
"""
from __future__ import annotations

import dataclasses
import shutil
import struct
from collections import Counter
from pathlib import Path

import pytest

from kvbridge.backends.chat_template import FALLBACK_COUNTER, ChatTemplate, chatml
from kvbridge.settings import EMBEDDED_MODEL_PATH, Settings

MESSAGES = [{"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "What colour is the sky on a clear day?"}]

needs_model = pytest.mark.skipif(not EMBEDDED_MODEL_PATH.is_file(),
                                 reason=f"embedded model {EMBEDDED_MODEL_PATH} missing: run ./scripts/setup.sh")


# --- the rule, on its own -------------------------------------------------------------------------

def template(text: str, *, adds_bos: bool, counters: Counter | None = None) -> ChatTemplate:
    return ChatTemplate(text, bos_text="<s>", eos_text="</s>", tokenizer_adds_bos=adds_bos,
                        counters=counters if counters is not None else Counter())


BOS_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


def test_a_template_that_writes_bos_loses_it_when_the_tokenizer_adds_it():
    assert template(BOS_TEMPLATE, adds_bos=True).render(MESSAGES).startswith("[system]")
    assert template(BOS_TEMPLATE, adds_bos=False).render(MESSAGES).startswith("<s>[system]")


def test_bos_is_stripped_exactly_once():
    twice = "{{ bos_token }}" + BOS_TEMPLATE
    assert template(twice, adds_bos=True).render(MESSAGES).startswith("<s>[system]")


@pytest.mark.parametrize("broken", [
    "{{ raise_exception('only user and assistant roles are supported') }}",
    "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}",   # does not even parse
])
def test_a_failing_template_is_counted_and_falls_back_to_chatml(broken):
    counters = Counter()
    assert template(broken, adds_bos=False, counters=counters).render(MESSAGES) == chatml(MESSAGES)
    assert counters[FALLBACK_COUNTER] == 1


def test_template_fallbacks_reach_the_engine_metrics(tmp_path):
    """The counter a backend's template writes into is the one CachedEngine drains after a request."""
    from kvbridge.backends.base import Backend

    backend = Backend(Settings())
    rendered = template("{{ raise_exception('no') }}", adds_bos=False, counters=backend.counters)
    rendered.render(MESSAGES)
    assert backend.take_counters() == {FALLBACK_COUNTER: 1}
    rendered.render(MESSAGES)   # still counting into the same Counter after it was drained
    assert backend.take_counters() == {FALLBACK_COUNTER: 1}


# --- a GGUF whose tokenizer adds BOS and whose template writes it ---------------------------------

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _skip_value(data: bytes, pos: int, kind: int) -> int:
    if kind in _SCALARS:
        return pos + struct.calcsize("<" + _SCALARS[kind])
    if kind == _STRING:
        (n,) = struct.unpack_from("<Q", data, pos)
        return pos + 8 + n
    if kind == _ARRAY:
        elem, n = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if elem in _SCALARS:
            return pos + n * struct.calcsize("<" + _SCALARS[elem])
        for _ in range(n):
            pos = _skip_value(data, pos, elem)
        return pos
    raise ValueError(f"GGUF value type {kind}")


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def with_metadata(source: Path, target: Path, changes: dict[str, tuple[int, bytes]]) -> None:
    """Copy a GGUF (format v3) with some metadata values replaced: {key: (type, encoded value)}."""
    with open(source, "rb") as f:
        head = f.read(64 << 20)   # the metadata and tensor table sit well inside the first 64 MiB
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", head, 0)
    assert magic == b"GGUF" and version == 3
    pos, kvs, alignment = 24, [], 32
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", head, pos)
        key = head[pos + 8: pos + 8 + n].decode()
        (kind,) = struct.unpack_from("<I", head, pos + 8 + n)
        start = pos + 12 + n
        pos = _skip_value(head, start, kind)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", head, start)
        kvs.append((key, kind, head[start:pos]))
    table_start = pos
    for _ in range(n_tensors):
        pos = _skip_value(head, pos, _STRING)
        (n_dims,) = struct.unpack_from("<I", head, pos)
        pos += 4 + 8 * n_dims + 4 + 8
    data_start = -(-pos // alignment) * alignment
    out = [struct.pack("<4sIQQ", magic, version, n_tensors, n_kv)]
    for key, kind, value in kvs:
        kind, value = changes.get(key, (kind, value))
        out.append(_string(key) + struct.pack("<I", kind) + value)
    out.append(head[table_start:pos])
    header = b"".join(out)
    header += b"\0" * (-len(header) % alignment)
    with open(source, "rb") as src, open(target, "wb") as dst:
        dst.write(header)
        src.seek(data_start)
        shutil.copyfileobj(src, dst, 1 << 22)


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory) -> Path:
    """SmolLM2 with BOS = <|endoftext|> (id 0), added by the tokenizer, and a template that writes it too."""
    if not EMBEDDED_MODEL_PATH.is_file():
        pytest.skip(f"embedded model {EMBEDDED_MODEL_PATH} missing: run ./scripts/setup.sh")
    import llama_cpp

    original = llama_cpp.Llama(str(EMBEDDED_MODEL_PATH), vocab_only=True, verbose=False)
    chat_template = original.metadata["tokenizer.chat_template"]
    original.close()
    target = tmp_path_factory.mktemp("bos-model") / "smollm2-adds-bos.gguf"
    with_metadata(EMBEDDED_MODEL_PATH, target, {
        "tokenizer.ggml.bos_token_id": (4, struct.pack("<I", 0)),
        "tokenizer.ggml.add_bos_token": (7, b"\x01"),
        "tokenizer.chat_template": (_STRING, _string("{{ bos_token }}" + chat_template)),
    })
    return target


def renders(kind: str, model: Path, tmp_path: Path) -> tuple[str, list[int], int]:
    """(text, token ids, BOS id) from one renderer on `model`."""
    if kind == "gguf-vocab":
        from kvbridge.backends.gguf_vocab import GGUFVocab

        vocab = GGUFVocab(model)
        text = vocab.render(MESSAGES)
        return text, vocab.tokenize(text), vocab._llama.token_bos()
    from kvbridge.backends import make_backend

    settings = dataclasses.replace(Settings(), model_path=str(model), ctx_size=512, threads=1,
                                   l2_dir=str(tmp_path / "l2"), llama_start_timeout=60.0)
    backend = make_backend(kind, settings)
    backend.start()
    try:
        text = backend.render(MESSAGES)
        tokens = backend.tokenize(text)
        bos = backend.tokenize("")[0] if backend.tokenize("") else -1
        return text, tokens, bos
    finally:
        backend.stop()


def llama_server_available() -> bool:
    from kvbridge.backends.llama_server.process import built_binary, pinned_llama_cpp_version

    return built_binary(pinned_llama_cpp_version()).is_file()


@needs_model
@pytest.mark.parametrize("model_kind", ["embedded", "adds-bos"])
def test_every_local_renderer_gives_the_same_text_and_ids(model_kind, request, tmp_path):
    pytest.importorskip("llama_cpp")
    model = EMBEDDED_MODEL_PATH if model_kind == "embedded" else request.getfixturevalue("bos_model")
    engines = ["llamacpp", "gguf-vocab"] + (["llama-server"] if llama_server_available() else [])
    results = {kind: renders(kind, model, tmp_path) for kind in engines}
    text, tokens, bos = results["llamacpp"]
    for kind, (other_text, other_tokens, _) in results.items():
        assert (other_text, other_tokens) == (text, tokens), f"{kind} renders differently from llamacpp"
    assert text.startswith("<|im_start|>system\n")          # never the BOS text: the tokenizer adds it
    if model_kind == "adds-bos":
        assert bos == 0 and tokens[0] == 0 and tokens[1] != 0   # one BOS, then the template's first token
    else:
        assert bos == -1 and tokens[0] != tokens[1]
