"""The engine registry is the only list of engines: keys, aliases, clear errors for unknown names."""
import pytest

from kvbridge.backends import engine_specs, make_backend, resolve_engine
from kvbridge.backends.base import Backend
from kvbridge.backends.registry import EngineSpec, register_engine
from kvbridge.errors import UnknownEngineError
from kvbridge.settings.engines import known_engine_names


def test_llamacpp_registered_with_aliases():
    for name in ("llamacpp", "llama", "llama.cpp", "LLAMA.CPP"):
        assert resolve_engine(name).key == "llamacpp"
    assert resolve_engine("llamacpp").cls.kv_mode == "full"


def test_unknown_engine_lists_known_ones():
    with pytest.raises(UnknownEngineError) as info:
        resolve_engine("vllm-turbo")
    message = str(info.value)
    assert "vllm-turbo" in message and "KVB_ENGINE" in message
    for spec in engine_specs():
        assert spec.key in message


def test_every_engine_declares_kv_mode_and_fields():
    for spec in engine_specs():
        assert spec.cls.kv_mode in ("full", "shadow")
        assert spec.cls.key == spec.key
        assert spec.label and spec.blurb


def test_alias_clash_is_refused():
    class Dummy(Backend):
        key = "dummy-clash"

    with pytest.raises(ValueError):
        register_engine(EngineSpec(key="dummy-clash", label="x", cls=Dummy, aliases=("llama",)))
    assert "dummy-clash" not in known_engine_names()


def test_make_backend_builds_the_registered_class(make_settings):
    backend = make_backend("llama", make_settings())
    assert backend.key == "llamacpp" and backend.kv_mode == "full"


# -- isolation: a fake registered in one test is gone in the next (tests in a file run in order) -----
class _FakeForOneTest(Backend):
    key = "fake-for-one-test"


def test_a_fake_engine_can_be_registered_for_a_test():
    register_engine(EngineSpec(key="fake-for-one-test", label="fake", cls=_FakeForOneTest, blurb="test only"))
    assert resolve_engine("fake-for-one-test").cls is _FakeForOneTest


def test_the_fake_from_the_previous_test_is_gone():
    assert "fake-for-one-test" not in known_engine_names()
    assert {"llamacpp", "llama-server", "ollama", "cloud"} <= set(known_engine_names())
