"""Export: CSV and JSON hold every record, the HTML report opens offline, and no secret is written."""
from __future__ import annotations

import csv
import json
import re

import pytest

from kvbridge.gui.charts import run_figures
from kvbridge.gui.export import REDACTED, export_run, scrub_meta
from kvbridge.engine.records import RECORD_FIELDS, RequestRecord


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        RequestRecord(mode="cold", request_index=1, label="Q1: <who?>", ttft_ms=900.5, prompt_tokens=300,
                      text="The manager, \"Ana\", runs it.\nSecond line.", engine_cached_tokens=None),
        RequestRecord(mode="lmcache", request_index=1, label="Q1: <who?>", ttft_ms=45.25, prompt_tokens=300,
                      matched_tokens=288, tier="L2", restore_ok=True, notes="approx; restore ineffective",
                      engine_cached_tokens=288),
    ]


def test_csv_and_json_hold_every_record(tmp_path, records):
    paths = export_run(records, tmp_path / "out", basename="run1", meta={"scenario": "doc-qa"})
    assert set(paths) == {"csv", "json"}  # no figures: no HTML (the bench CLI's use)
    with paths["csv"].open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == RECORD_FIELDS
    assert [r["mode"] for r in rows] == ["cold", "lmcache"]
    assert rows[0]["text"] == records[0].text  # quotes and newlines survive
    assert rows[0]["engine_cached_tokens"] == "" and rows[1]["engine_cached_tokens"] == "288"
    doc = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert doc["format"] == "kvbridge-run v1"
    assert doc["records"] == [r.to_dict() for r in records]
    assert doc["meta"] == {"scenario": "doc-qa"}
    lm = {s["mode"]: s for s in doc["summary"]}["lmcache"]
    assert lm["speedup_mean_vs_cold"] == pytest.approx(round(900.5 / 45.25, 2))


def test_html_report_is_self_contained(tmp_path, records):
    paths = export_run(records, tmp_path, figures=run_figures(records), meta={"scenario": "doc-qa"})
    page = paths["html"].read_text(encoding="utf-8")
    for name in run_figures(records):
        assert f'id="chart-{name}"' in page
    assert len(page) > 3_000_000  # plotly.js itself is inlined
    assert not re.search(r"<script[^>]+src=", page) and "<link" not in page  # nothing fetched from elsewhere
    assert "Q1: &lt;who?&gt;" in page and "restore ineffective" in page  # escaped, notes shown
    assert paths["html"].name.startswith("kvbridge-doc-qa-")


def test_second_export_does_not_overwrite(tmp_path, records):
    first = export_run(records, tmp_path, basename="same")
    second = export_run(records[:1], tmp_path, basename="same")
    assert first["csv"] != second["csv"] and first["csv"].exists() and second["csv"].exists()
    assert second["csv"].name == "same-2.csv"


def test_no_secret_is_written(tmp_path, records, monkeypatch):
    secret = "sk-test-0123456789abcdefSECRET"
    monkeypatch.setenv("MY_PROVIDER_KEY", secret)
    meta = {"cloud_api_key_env": "MY_PROVIDER_KEY", "api_key": secret,
            "cloud_extra_headers": '{"Authorization": "Bearer ' + secret + '"}',
            "nested": {"authorization": "Bearer " + secret, "model": "m"}, "cloud_token_budget": 5000}
    paths = export_run(records, tmp_path, figures=run_figures(records), meta=meta)
    for path in paths.values():
        text = path.read_text(encoding="utf-8")
        assert secret not in text, path.name
    doc = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert doc["meta"]["cloud_api_key_env"] == "MY_PROVIDER_KEY"  # the variable's name is fine
    assert doc["meta"]["api_key"] == REDACTED and doc["meta"]["nested"]["authorization"] == REDACTED
    assert doc["meta"]["cloud_token_budget"] == 5000


def test_scrub_meta_keeps_empty_values():
    assert scrub_meta({"api_key": "", "cloud_extra_headers": None}) == {"api_key": "", "cloud_extra_headers": None}
