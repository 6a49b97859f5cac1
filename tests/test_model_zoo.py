"""The model zoo (kvbridge.models): every architecture makes a GGUF that llama.cpp loads and answers on.

Each model is made once (zoo_model caches it under models/zoo/) at the `test` size and probed in a
child process (kvbridge.models.probe), so a crash in llama.cpp fails its test, not the run. The
probe answers three prompts greedily in two fresh contexts: the same tokens both times, and a median
top-1 to top-2 margin well above float noise, so an exactness oracle on these models is not decided
by rounding. The attention and sliding-window models also answer through the real llama-server.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from conftest import needs_llama_server_and_model, needs_model
from kvbridge.models import FAMILIES, ZOO_ARCHITECTURES, UnknownArchitecture, make_model, zoo_model
from kvbridge.models.probe import probe_in_child
from kvbridge.models.tokenizer import tokenizer_fields
from kvbridge.models.writer import TOKENIZER_SOURCE
from kvbridge.models.zoo import main as zoo_main
from kvbridge.settings import WORK_DIR

pytestmark = needs_model   # the tokenizer of every zoo model is the embedded SmolLM2's

NAMES = [a.name for a in ZOO_ARCHITECTURES]
MIN_MEDIAN_MARGIN = 0.5    # logits; batch-split noise on these models is ~0.01


def test_the_zoo_has_every_architecture_the_issue_names():
    assert {"llama", "gemma2", "gemma3", "gpt-oss", "cohere2", "llama4", "gemma3n", "lfm2", "granitehybrid",
            "qwen3next", "qwen35", "falcon-h1", "mamba2", "rwkv7"} <= set(NAMES)
    assert all(a.family in FAMILIES and a.kv_shape for a in ZOO_ARCHITECTURES)


def test_list_prints_each_architecture_with_its_family(capsys):
    assert zoo_main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == NAMES
    assert all(line.split()[1] in FAMILIES for line in lines)


def test_an_unknown_architecture_is_refused_naming_the_known_ones(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvbridge.models.zoo", "make", "gpt-5", "--out", str(tmp_path / "x.gguf")],
                          cwd=WORK_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "'gpt-5'" in done.stderr and all(name in done.stderr for name in NAMES)
    with pytest.raises(UnknownArchitecture, match="lfm2"):
        zoo_model("gpt-5")
    assert not list(tmp_path.iterdir())


def test_the_same_seed_gives_the_same_bytes_and_the_tokenizer_of_smollm2(tmp_path):
    first, again, other = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    make_model("lfm2", first, seed=3)
    make_model("lfm2", again, seed=3)
    make_model("lfm2", other, seed=4)
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert tokenizer_fields(first) == tokenizer_fields(TOKENIZER_SOURCE.path)
    assert any(key == "tokenizer.chat_template" for key, *_ in tokenizer_fields(first))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]   # no partial files left


def test_zoo_model_makes_once_and_then_serves_the_cached_file(tmp_path):
    path = zoo_model("llama", directory=tmp_path)
    made = path.stat().st_mtime_ns
    assert zoo_model("llama", directory=tmp_path) == path and path.stat().st_mtime_ns == made
    assert zoo_model("llama", seed=1, directory=tmp_path) != path


# gemma3n is the heaviest test-size model (22 layers, a 150 MB per-layer token table): over 10 s to probe
PROBED = [pytest.param(name, marks=[pytest.mark.slow] if name == "gemma3n" else []) for name in NAMES]


@pytest.mark.live
@pytest.mark.parametrize("arch", PROBED)
def test_every_architecture_loads_in_process_and_answers_greedily_twice_alike(arch):
    seen = probe_in_child(zoo_model(arch), n_tokens=4, timeout_s=300)
    assert seen["tokens"] == seen["repeat_tokens"]
    assert seen["median_margin"] > MIN_MEDIAN_MARGIN, seen
    assert len({tuple(t) for t in seen["tokens"]}) > 1, "every prompt got the same answer: the context is ignored"


def _marked(marks):
    def apply(test):
        for mark in marks:
            test = mark(test)
        return test
    return apply


@pytest.mark.slow
@_marked(needs_llama_server_and_model())
def test_the_attention_and_sliding_window_models_answer_in_llama_server():
    """One llama-server (--swa-full, as KVBridge starts it) per model in turn, one greedy completion each."""
    from kvbridge.backends.llama_server.process import ServerProcess, built_binary, free_port, pinned_llama_cpp_version

    binary = built_binary(pinned_llama_cpp_version())
    answers = {}
    for arch in [a.name for a in ZOO_ARCHITECTURES if a.family in ("attention", "sliding-window")]:
        server = ServerProcess(binary, ["-m", str(zoo_model(arch)), "-c", "1024", "-t", "2", "--swa-full"],
                               "127.0.0.1", free_port())
        server.start()
        try:
            server.wait_healthy(120)
            reply = requests.post(f"{server.url}/completion", timeout=120, json={
                "prompt": "The quick brown fox", "n_predict": 4, "temperature": 0, "cache_prompt": False}).json()
        finally:
            server.stop()
        answers[arch] = reply.get("tokens_predicted")
    assert answers == {arch: 4 for arch in answers} and len(answers) == 7
