"""GUI handlers without a browser: settings form, validation messages, runs, store panel, export.

The first half needs no engine (records are built by hand); the `live` half connects the real
embedded llama.cpp engine with a small chunk size and a short document.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from kvbridge.gui import handlers as h
from kvbridge.gui import store_panel as sp
from kvbridge.gui import results as r
from kvbridge.backends import engine_specs
from kvbridge.settings import EMBEDDED_MODEL_PATH, Settings
from kvbridge.errors import EngineUnavailable
from kvbridge.engine.records import RECORD_FIELDS, RequestRecord

TINY_DOC = "# Garden rota\n\n" + " ".join(
    f"Rule {i}: the {['north', 'south', 'east', 'west'][i % 4]} bed is watered on day {i % 7}." for i in range(12))


def small_settings(tmp_path: Path, **env: str) -> Settings:
    (tmp_path / "input").mkdir(exist_ok=True)
    base = {"KVB_L2_DIR": str(tmp_path / "l2"), "KVB_CHUNK_SIZE": "32", "KVB_N_PREDICT": "4",
            "KVB_CTX_SIZE": "1024", "KVB_INPUT_DIR": str(tmp_path / "input"), "KVB_OUTPUT_DIR": str(tmp_path / "out"),
            "KVB_L1_BYTES": "256MiB", "KVB_L2_BYTES": "512MiB",
            # one llama.cpp thread: two spin-wait for each other and crawl on 2 cores shared with anything else
            # (the live run test's 4 requests: 11 s and 5 s with one thread, 31 s and 22 s with two, at load ~2.3)
            "KVB_THREADS": "1"}
    return Settings.from_env(env={**base, **env}, env_file=None)


@pytest.fixture
def state(tmp_path) -> h.AppState:
    return h.AppState(small_settings(tmp_path), env_path=tmp_path / ".env")


def made_records() -> list[RequestRecord]:
    return [RequestRecord(mode="cold", request_index=1, ttft_ms=800.0, label="Q1", text="x" * 200),
            RequestRecord(mode="lmcache", request_index=1, ttft_ms=40.0, label="Q1", tier="L1",
                          matched_tokens=96, notes="restore ineffective: engine reused 0 of 96 restored tokens")]


# -- the engine form ---------------------------------------------------------------------------
def test_engine_radio_lists_the_registry():
    keys = [key for _, key in h.engine_choices()]
    assert keys == [spec.key for spec in engine_specs()]
    assert {"llamacpp", "llama-server", "ollama", "cloud"} <= set(keys)
    assert all(label and label != key for label, key in h.engine_choices())


def test_form_shows_each_engines_fields():
    fields = h.form_fields()
    for spec in engine_specs():
        shown = h.fields_for_engine(spec.key)
        assert set(spec.fields) <= shown <= set(fields)
    assert "cloud_api_key_env" in h.fields_for_engine("cloud") and "cloud_api_key_env" not in h.fields_for_engine("llamacpp")
    assert len(fields) == len(set(fields))


def test_embedded_models_are_offered_by_name_where_model_path_is(state):
    from kvbridge.settings.models import EMBEDDED_MODELS

    assert h.model_choices() == [(m.label, m.name) for m in EMBEDDED_MODELS.values()]
    fields = h.form_fields()
    assert fields.index("model") == fields.index("model_path") - 1   # just above the path that overrides it
    for spec in engine_specs():
        assert ("model" in h.fields_for_engine(spec.key)) == ("model_path" in spec.fields)
    values = {**h.form_values(state.settings), "model": "gemma3-270m"}
    settings, problems = h.settings_from_form(state.settings, "llamacpp", values)
    assert problems == [] and settings.model == "gemma3-270m"
    assert settings.resolved_model_path() == EMBEDDED_MODELS["gemma3-270m"].path
    own = {**values, "model_path": "/srv/models/own.gguf"}     # KVB_MODEL_PATH still wins
    assert h.settings_from_form(state.settings, "llamacpp", own)[0].resolved_model_path() == Path(own["model_path"])
    unknown = h.settings_from_form(state.settings, "llamacpp", {**values, "model": "nosuch"})[1]
    assert any("KVB_MODEL='nosuch'" in p for p in unknown)
    assert h.save_settings(state, "llamacpp", values).ok and "KVB_MODEL=gemma3-270m" in state.env_path.read_text()


def test_cloud_notice_says_prompts_leave_the_machine():
    assert "leave this machine" in h.engine_notice("cloud")
    assert "leave this machine" not in h.engine_notice("llamacpp")


def test_form_accepts_what_env_accepts(state):
    values = h.form_values(state.settings)
    values.update(l1_bytes="512MiB", chunk_size="64", flash_attn=True)
    settings, problems = h.settings_from_form(state.settings, "llama.cpp", values)
    assert problems == []
    assert (settings.engine, settings.l1_bytes, settings.chunk_size, settings.flash_attn) == ("llamacpp", 512 << 20, 64, True)
    assert settings.l2_dir == state.settings.l2_dir  # fields not in the form keep their value


def test_bad_settings_are_messages_naming_the_variable(state):
    values = {**h.form_values(state.settings), "chunk_size": "lots", "l2_bytes": "big"}
    outcome = h.connect_engine(state, "llamacpp", values)
    assert not outcome.ok and state.engine is None
    assert "KVB_CHUNK_SIZE" in outcome.message and "KVB_L2_BYTES" in outcome.message
    assert "Traceback" not in outcome.message
    unknown = h.connect_engine(state, "vllm-turbo", values)
    assert not unknown.ok and "llamacpp" in unknown.message  # lists the known engines


def test_save_settings_keeps_the_file_and_never_writes_a_key(state):
    state.env_path.write_text("# my settings\nKVB_PORT=7999  # chosen\nOTHER=1\n")
    values = {**h.form_values(state.settings), "chunk_size": "128"}
    outcome = h.save_settings(state, "llamacpp", values)
    assert outcome.ok, outcome.message
    text = state.env_path.read_text()
    assert text.startswith("# my settings\nKVB_PORT=7999  # chosen\nOTHER=1\n")
    assert "KVB_CHUNK_SIZE=128" in text and "KVB_ENGINE=llamacpp" in text
    before = state.env_path.read_text()
    secret = "sk-proj-abcdefghijklmnopqrstuvwxyz012345"
    cloud = {**h.form_values(state.settings), "cloud_api_key_env": secret, "cloud_base_url": "http://127.0.0.1:9/v1",
             "cloud_model": "m"}
    refused = h.save_settings(state, "cloud", cloud)
    assert not refused.ok and secret not in refused.message
    assert state.env_path.read_text() == before


def test_status_before_connect(state):
    assert "Not connected" in h.engine_status(state)
    assert "connect" in sp.store_markdown(sp.store_stats(state)).lower()


# -- connecting when the server starts ---------------------------------------------------------
def test_an_engine_whose_prompts_leave_the_machine_waits_for_connect(tmp_path):
    state = h.AppState(small_settings(tmp_path, KVB_ENGINE="cloud"), env_path=tmp_path / ".env")
    assert h.start_connect(state) is None and state.engine is None
    status = h.engine_status(state)
    assert "Not connected" in status and "sends prompts to the provider" in status and "**Connect**" in status


def test_a_failed_connect_on_start_says_why_and_leaves_the_panel_to_fix_it(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model" * 100)   # passes the settings check; loading it fails
    state = h.AppState(small_settings(tmp_path, KVB_MODEL_PATH=str(bad)), env_path=tmp_path / ".env")
    future = h.start_connect(state)
    assert h.start_connect(state) is future   # a reload or a second tab never starts a second connect
    outcome = future.result(timeout=60)
    assert not outcome.ok and "bad.gguf" in outcome.message and state.engine is None
    assert "bad.gguf" in h.connect_on_start_message(state)
    assert "engine panel says why" in h.engine_status(state)
    views = list(r.run_stream(state, "doc-qa", ["cold"], 1, None))   # Run: the cause and where to fix it
    assert len(views) == 1 and "bad.gguf" in views[0].message and "Engine panel" in views[0].message
    assert "Connect an engine first" not in views[0].message
    assert h.start_connect(state) is future   # not retried on its own: the panel's Connect does that


def test_page_builds_with_registry_engines_and_worded_labels(state):
    """Every settings input: a label in words from kvbridge.gui.labels, its KVB_ variable as the hint beneath."""
    import gradio as gr

    from kvbridge.gui.app import build_app
    from kvbridge.gui.labels import FIELD_TEXT, SETTING_CLASS
    from kvbridge.settings import env_name

    demo = build_app(state.settings, state)
    blocks = list(demo.blocks.values())
    by_id = {b.elem_id: b for b in blocks if getattr(b, "elem_id", None)}
    for name in h.form_fields():
        assert name in FIELD_TEXT, f"{name} has no words in kvbridge.gui.labels.FIELD_TEXT"
        field = by_id[f"kvb-field-{name}"]
        assert field.label == FIELD_TEXT[name][0] and field.info.startswith(env_name(name))
        assert SETTING_CLASS in field.elem_classes
    settings_inputs = [b for b in blocks if SETTING_CLASS in (getattr(b, "elem_classes", None) or [])]
    assert {"kvb-lab-cells", "kvb-lab-soft", "kvb-prompt-tokens"} <= {b.elem_id for b in settings_inputs}
    assert all(re.match(r"KVB_[A-Z0-9_]+", b.info) for b in settings_inputs)
    assert not [b.label for b in blocks if str(getattr(b, "label", "") or "").startswith("KVB_")]
    radio = next(b for b in blocks if isinstance(b, gr.Radio) and b.elem_id == "kvb-engine")
    assert [value for _, value in radio.choices] == [key for _, key in h.engine_choices()]
    from kvbridge.settings.models import EMBEDDED_MODELS

    model = next(b for b in blocks if getattr(b, "elem_id", None) == "kvb-field-model")
    assert isinstance(model, gr.Dropdown) and model.value == state.settings.model
    assert [value for _, value in model.choices] == list(EMBEDDED_MODELS)
    assert demo.app_state is state


def test_a_setting_input_is_words_above_its_variable():
    from kvbridge.gui.labels import SETTING_CLASS, field_label, setting_input

    assert setting_input("threads") == {"label": "CPU threads", "info": "KVB_THREADS: 0: all cores",
                                        "elem_classes": [SETTING_CLASS]}
    assert setting_input("l2_enabled")["info"] == "KVB_L2_ENABLED"   # the label says it all
    assert setting_input("n_predict", note="")["info"] == "KVB_N_PREDICT"
    assert field_label("not_yet_worded") == "Not yet worded"   # a new engine's field is words, never KVB_


def test_main_explains_a_busy_port(tmp_path, capsys):
    import dataclasses
    import socket

    from kvbridge.gui.app import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        settings = dataclasses.replace(small_settings(tmp_path), port=busy.getsockname()[1])
        assert main(settings) == 2
    err = capsys.readouterr().err
    assert "KVB_PORT" in err and "GRADIO" not in err and "Traceback" not in err


def test_an_alias_in_kvb_engine_selects_its_engine(tmp_path):
    assert h.selected_engine(small_settings(tmp_path, KVB_ENGINE="llama.cpp")) == "llamacpp"
    assert h.selected_engine(small_settings(tmp_path, KVB_ENGINE="nonsense")) == h.engine_choices()[0][1]


# -- handlers that need an engine answer with a message instead --------------------------------
def test_no_engine_messages_and_results_are_kept(state):
    state.records = made_records()
    views = list(r.run_stream(state, "doc-qa", ["cold"], 1, None))
    assert len(views) == 1 and not views[0].ok and "Connect an engine" in views[0].message
    assert len(views[0].table["data"]) == 2  # what was shown stays
    assert not r.free_prompt(state, "hi", "lmcache").ok
    assert not h.restart_engine(state).ok
    assert not sp.clear_tier(state, "L1").ok
    assert "Connect an engine" in sp.clear_tier(state, "L9").message
    assert sp.store_tier_names(state) == []


@pytest.mark.parametrize("modes, n, expected", [([], 2, "at least one mode"), (["warm"], 2, "Unknown mode"),
                                                (["cold"], 0, "at least 1"), (["cold"], "two", "whole number")])
def test_run_request_is_checked(state, modes, n, expected):
    problems = r.check_run_request(state, modes, n)
    assert any(expected in p for p in problems)


def test_table_has_every_record_field_and_notes():
    table = r.records_table(made_records())
    assert sorted(r.column_field(h) for h in table["headers"]) == sorted(RECORD_FIELDS)
    row = dict(zip(map(r.column_field, table["headers"]), table["data"][1]))
    assert row["notes"].startswith("restore ineffective") and row["tier"] == "L1"
    assert len(dict(zip(table["headers"], table["data"][0]))["text"]) == r.TEXT_PREVIEW_CHARS + 1
    assert "20.0×" in r.summary_markdown(made_records())


def test_the_summary_says_how_many_answers_equal_cold_and_state_the_expected_fact():
    """A RAG run: each mode's answers against cold's, and against the fact the corpus expects."""
    def record(mode: str, index: int, text: str) -> RequestRecord:
        return RequestRecord(mode=mode, request_index=index, ttft_ms=100.0 if mode == "cold" else 10.0,
                             text=text, expected="the Kessel Tunnel", scenario="rag")

    records = [record("cold", 1, "It is the Kessel Tunnel."), record("cold", 2, "The Kessel tunnel, 640 m."),
               record("blend", 1, "It is the Kessel Tunnel."), record("blend", 2, "The Brisk tunnel.")]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in r.summary_markdown(records).splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["mode"][-2:] == ["answers = cold", "states the expected fact"]
    assert rows["cold"][-2:] == ["baseline", "2/2"] and rows["blend"][-2:] == ["1/2", "1/2"]
    # a run without expected answers and without cold has neither column
    assert "answers = cold" not in r.summary_markdown(made_records()[1:])


def test_export_handler_writes_the_records(state):
    outcome, paths = r.export_results(state)
    assert not outcome.ok and paths == []
    state.records, state.run_meta = made_records(), {"scenario": "doc-qa", "engine": "llamacpp"}
    outcome, paths = r.export_results(state)
    assert outcome.ok, outcome.message
    suffixes = sorted(Path(p).suffix for p in paths)
    assert suffixes == [".csv", ".html", ".json"]
    assert all(Path(p).parent == Path(state.settings.output_dir) for p in paths)
    doc = json.loads(Path(next(p for p in paths if p.endswith(".json"))).read_text())
    assert len(doc["records"]) == 2 and doc["meta"]["scenario"] == "doc-qa"


def test_unexpected_errors_are_logged_not_shown(caplog):
    with caplog.at_level(logging.ERROR):
        try:
            raise ZeroDivisionError("boom")
        except ZeroDivisionError as exc:
            message = h.failure_message("Run", exc)
    assert "boom" in message and "server log" in message and "Traceback" not in message
    assert caplog.records and caplog.records[0].exc_info
    assert h.failure_message("Connect", EngineUnavailable("model missing")) == "Connect failed: model missing"


def test_connect_with_a_missing_model_is_a_message(state, tmp_path):
    values = {**h.form_values(state.settings), "model_path": str(tmp_path / "nope.gguf")}
    outcome = h.connect_engine(state, "llamacpp", values)
    assert not outcome.ok and "nope.gguf" in outcome.message and state.engine is None


# -- live: the real embedded engine -------------------------------------------------------------
needs_model = pytest.mark.skipif(not EMBEDDED_MODEL_PATH.is_file(),
                                 reason=f"embedded model {EMBEDDED_MODEL_PATH} missing (run ./scripts/setup.sh)")


@pytest.fixture(scope="module")
def live_state(tmp_path_factory):
    """Connected as `kvbridge gui` connects on start; a prompt sent while the model loads waits for it."""
    tmp = tmp_path_factory.mktemp("gui")
    settings = small_settings(tmp)
    (Path(settings.input_dir) / "garden.md").write_text(TINY_DOC)
    state = h.AppState(settings, env_path=tmp / ".env")
    future = h.start_connect(state)
    assert "Connecting to" in h.engine_status(state)   # the model takes seconds to load
    pressed = h.connect_engine(state, "llamacpp", h.form_values(settings))   # the panel's Connect meanwhile
    assert not pressed.ok and "Wait for it" in pressed.message
    answer = r.free_prompt(state, "Hello", "cold", 1)   # sent at once: waits for the connect, then answers
    assert answer.ok, answer.message
    assert future.result().ok and h.start_connect(state) is future
    yield state
    h.disconnect_engine(state)
    assert state.engine is None


@pytest.mark.live
@needs_model
def test_live_connect_status(live_state):
    status = h.engine_status(live_state)
    assert "FULL" in status and "SmolLM2" in status and "Namespace" in status
    assert "**Model:** llama, 30 layers, plain KV" in status and "refused" not in status
    assert "input/garden.md" in r.document_choices(live_state)


@pytest.fixture
def no_settle(monkeypatch):
    """No pause after a request for a page to draw its charts: no page here (run_stream's GUI_SETTLE_S)."""
    monkeypatch.setattr(r, "GUI_SETTLE_S", 0.0)


@pytest.mark.live
@needs_model
def test_live_run_streams_records_and_keeps_them_on_failure(live_state, no_settle):
    seen = []
    views = list(r.run_stream(live_state, "doc-qa", ["cold", "lmcache"], 2, "input/garden.md",
                              progress=lambda value, desc, unit: seen.append(value)))
    assert all(v.ok for v in views), [v.message for v in views if not v.ok]
    assert [len(v.table["data"]) for v in views] == [0, 1, 2, 3, 4, 4]  # one update per request
    assert seen[0] == (0, 4) and seen[-1] == (4, 4)
    records = live_state.records
    assert [(x.mode, x.request_index) for x in records] == [("cold", 1), ("cold", 2), ("lmcache", 1), ("lmcache", 2)]
    assert records[3].tier in ("L1", "L2") and records[3].matched_tokens >= 32, records[3].notes
    assert set(views[-1].figures) >= {"speedup", "ttft_per_request", "ttft_summary", "hits", "store"}
    # a failing run says why and leaves the shown results alone
    failed = list(r.run_stream(live_state, "no-such-scenario", ["cold"], 1, None))
    assert not failed[-1].ok and "no-such-scenario" in failed[-1].message
    assert live_state.records is records and len(failed[-1].table["data"]) == 4


@pytest.mark.live
@needs_model
def test_live_rag_run_asks_about_the_corpus_picked(tmp_path, no_settle):
    from kvbridge.bench.rag import load_corpus

    settings = small_settings(tmp_path, KVB_CTX_SIZE="2048")   # 4 passages: ~1.1k tokens
    state = h.AppState(settings, env_path=tmp_path / ".env")
    assert h.connect_engine(state, "llamacpp", h.form_values(settings)).ok
    try:
        clinic = {q["answer"] for q in load_corpus("clinic")["questions"]}
        views = list(r.run_stream(state, "rag", ["cold"], 1, None, corpus="clinic"))
        assert all(v.ok for v in views), [v.message for v in views if not v.ok]
        assert [x.expected in clinic for x in state.records] == [True]
        assert state.run_meta["corpus"] == "clinic"
    finally:
        h.disconnect_engine(state)


@pytest.mark.live
@needs_model
def test_live_stop_and_busy(live_state, no_settle):
    views = []
    for view in r.run_stream(live_state, "doc-qa", ["cold"], 3, "input/garden.md"):   # short cold prefills
        views.append(view)
        if len(view.table["data"]) == 1:  # the person presses Stop while request 2 is due
            assert r.request_stop(live_state).ok
    assert views[-1].message.startswith("Stopped") and len(live_state.records) == 1
    assert live_state.engine_lock.acquire(blocking=False)
    try:
        busy = list(r.run_stream(live_state, "doc-qa", ["cold"], 1, None))
        assert "already using the engine" in busy[0].message
        assert "busy" in h.restart_engine(live_state).message
    finally:
        live_state.engine_lock.release()


@pytest.mark.live
@needs_model
def test_live_restart_then_restore_from_l1_and_l2(live_state):
    prompt = TINY_DOC + "\n\nWhich bed is watered on day 3?"
    first = r.free_prompt(live_state, prompt, "lmcache", 4)
    assert first.ok, first.message
    assert h.restart_engine(live_state, drop_l1=False).ok
    from_l1 = r.free_prompt(live_state, prompt, "lmcache", 4)
    row = dict(zip(from_l1.record["headers"], from_l1.record["data"][0]))
    assert row["tier"] == "L1" and row["matched_tokens"] > 0, from_l1.message
    assert from_l1.answer == first.answer
    outcome = h.restart_engine(live_state, drop_l1=True)
    assert outcome.ok and "L2" in outcome.message
    from_l2 = r.free_prompt(live_state, prompt, "lmcache", 4)
    row = dict(zip(from_l2.record["headers"], from_l2.record["data"][0]))
    assert row["tier"] == "L2", from_l2.message
    assert from_l2.answer == first.answer


@pytest.mark.live
@needs_model
def test_live_clear_tiers(live_state):
    r.free_prompt(live_state, TINY_DOC + "\n\nName the west bed's day.", "lmcache", 2)
    assert sp.store_stats(live_state)["tiers"]["L2"]["objects"] > 0
    assert sp.store_tier_names(live_state) == live_state.engine.store.tier_names == ["L1", "L2"]
    for tier in live_state.engine.store.tier_names:
        assert sp.clear_tier(live_state, tier).ok
        assert sp.store_stats(live_state)["tiers"][tier]["objects"] == 0
    refused = sp.clear_tier(live_state, "L9")
    assert not refused.ok and "no tier 'L9'" in refused.message and "L1, L2" in refused.message
    assert "| L1 | 0 |" in sp.store_markdown(sp.store_stats(live_state))


# -- a shadow engine: the cloud adapter against a loopback replay of a provider's stream ---------
FAKE_KEY = "sk-kvbgui-FAKE-0123456789abcdef-NEVER-SHOWN"


def test_shadow_cloud_engine_status_budget_and_charts(tmp_path, monkeypatch):
    """Hosted providers cannot be reached from here: a recorded OpenAI stream is replayed on loopback."""
    from replay_server import Reply, ReplayServer, load_fixture

    monkeypatch.setenv("KVB_GUI_TEST_KEY", FAKE_KEY)
    recorded = load_fixture("cloud_openai_stream.json")
    state = h.AppState(small_settings(tmp_path), env_path=tmp_path / ".env")
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions", Reply.sse(recorded["sse"]))
        values = {**h.form_values(state.settings), "cloud_base_url": server.url + "/v1", "cloud_model": "gpt-4.1-mini",
                  "cloud_api_key_env": "KVB_GUI_TEST_KEY", "cloud_token_budget": "10000"}
        outcome = h.connect_engine(state, "cloud", values)
        assert outcome.ok, outcome.message
        try:
            status = h.engine_status(state)
            assert "SHADOW" in status and "leave this machine" in status.lower()
            assert "Token budget left:** 10,000" in status
            views = list(r.run_stream(state, "system-prompt", ["lmcache"], 2, None))
            assert views[-1].ok, views[-1].message
            assert views[-1].has_shadow and "shadow" in views[-1].figures
            assert all(x.kv_mode == "shadow" and x.predicted_reuse_tokens is not None for x in state.records)
            assert state.records[1].predicted_reuse_tokens > 0  # the shared system prompt was indexed
            assert "Token budget left:** 5,972" in h.engine_status(state)  # 2 x 2,014 billed tokens
            _, paths = r.export_results(state)
            for path in paths:
                assert FAKE_KEY not in Path(path).read_text(encoding="utf-8")
        finally:
            h.disconnect_engine(state)
    assert FAKE_KEY not in status
