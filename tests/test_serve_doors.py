"""Every door of `serve` says whom it serves (issue 46): the app on a loopback port of this process over a real
scheduler (the embedded model), called with requests over HTTP as a client would.

- every route of the app (read from the app object itself, so a route added later without a row fails here)
  is called with a tenant's, the operator's and the router's key, and on a server with no key configured, and
  answers as the table "Who may call which route" in Docs/Serve.md says;
- a tenant's X-KVBridge-Priority counts only as far as the tenants file grants (`max_priority`): the priority
  the scheduler received is read off its own record, and X-KVBridge-Priority-Applied says it;
- the tenants file's grant and the router's key are checked at start, each refusal naming the file or setting.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from conftest import needs_model
from kvbridge.errors import BadSettings
from kvbridge.serve.tenants import TenantTable, key_digest
from kvbridge.settings import Settings

SERVE_DOC = Path(__file__).resolve().parents[1] / "Docs" / "Serve.md"
KEYS = {"tenant": "doors-key-alice", "bob": "doors-key-bob", "operator": "doors-key-operator",
        "router": "doors-key-router"}
COLUMNS = ("no key configured", "tenant", "operator", "router")


def route_table() -> dict[tuple[str, str], dict[str, bool]]:
    """{(method, path): {column: allowed}} from the table in Docs/Serve.md ("yes ..." or "no ...")."""
    text = SERVE_DOC.read_text()
    section = text[text.index("### Who may call which route"):]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("### "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 + len(COLUMNS) or not cells[0].startswith("`"):
            continue
        rows[(cells[1], cells[0].strip("`"))] = {col: cell.split()[0] == "yes" for col, cell in zip(COLUMNS, cells[2:])}
    assert rows, "no route table under '### Who may call which route' in Docs/Serve.md"
    return rows


def app_routes(endpoint) -> list[tuple[str, str]]:
    """(method, path) of every route of the running app (HEAD, which Starlette adds to GET, left out)."""
    app = endpoint.server.config.app
    return sorted((method, route.path) for route in app.routes for method in route.methods if method != "HEAD")


def call(url: str, method: str, path: str, key: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if method == "GET":
        return requests.get(url + path, headers=headers, timeout=120)
    body = ({"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1} if "chat" in path
            else {"model": "x", "prompt": "Hi", "max_tokens": 1})
    return requests.post(url + path, json=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kvbridge.scheduler import Scheduler
    from kvbridge.serve.engines import SchedulerEngine

    class KeptScheduler(Scheduler):
        """The real scheduler, keeping the future of every request it was handed (its record says the priority
        the scheduler took)."""

        def __init__(self, settings) -> None:
            super().__init__(settings)
            self.futures = []

        def submit(self, *args, **kwargs):
            future = super().submit(*args, **kwargs)
            self.futures.append(future)
            return future

    tmp = tmp_path_factory.mktemp("doors")
    tenants = tmp / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [
        {"name": "alice", "key_sha256": key_digest(KEYS["tenant"]), "max_priority": 7},
        {"name": "bob", "key_sha256": key_digest(KEYS["bob"])}]}))
    settings = Settings(chunk_size=32, ctx_size=1024, sched_kv_cells=3072, serve_max_tokens=8, serve_port=0,
                        l2_dir=str(tmp / "l2"), output_dir=str(tmp / "output"))
    serving = SchedulerEngine(settings, scheduler=KeptScheduler(settings))
    yield settings, serving, tenants
    serving.close()


def serving(settings, engine, monkeypatch, **changes):
    from kvbridge.serve.server import BackgroundServe

    monkeypatch.setenv("DOORS_ADMIN_KEY", KEYS["operator"])
    monkeypatch.setenv("DOORS_ROUTER_KEY", KEYS["router"])
    return BackgroundServe(settings.replace(**changes), engine, port=0)


def keyed(settings, engine, tenants, monkeypatch):
    return serving(settings, engine, monkeypatch, serve_tenants_file=str(tenants),
                   serve_admin_key_env="DOORS_ADMIN_KEY", serve_router_key_env="DOORS_ROUTER_KEY")


@needs_model
def test_every_route_answers_whom_the_table_says(engine, monkeypatch):
    settings, scheduler_engine, tenants = engine
    table = route_table()
    endpoint = keyed(settings, scheduler_engine, tenants, monkeypatch)
    try:
        routes = app_routes(endpoint)
        assert set(routes) == set(table), ("routes of the app without a row in Docs/Serve.md's table, or rows "
                                           f"without a route: {sorted(set(routes) ^ set(table))}")
        for method, path in routes:
            for who in ("tenant", "operator", "router"):
                answer = call(endpoint.url, method, path, KEYS[who])
                allowed = table[(method, path)][who]
                seen = f"{who} {method} {path}: {answer.status_code} {answer.text[:300]}"
                if allowed:
                    assert answer.status_code not in (401, 403), seen
                else:
                    assert answer.status_code == 403, seen
                    error = answer.json()["error"]
                    assert error["type"] == "permission_error", seen
                    assert re.search(r"KVB_SERVE_(ADMIN|ROUTER)_KEY_ENV|KVB_SERVE_TENANTS_FILE", error["message"]), seen
        # the state routes refuse the tenant, naming who they answer; what they would have said is not in it
        refused = call(endpoint.url, "GET", "/get_server_info", KEYS["tenant"]).json()["error"]
        assert refused["code"] == "not_for_tenants" and "KVB_SERVE_ROUTER_KEY_ENV" in refused["message"]
        assert ".gguf" not in json.dumps(refused)
        assert call(endpoint.url, "GET", "/get_load", "not-a-key").status_code == 401
    finally:
        endpoint.stop()
    open_endpoint = serving(settings, scheduler_engine, monkeypatch)   # no key at all: one local user
    try:
        for method, path in routes:
            if table[(method, path)]["no key configured"]:
                answer = call(open_endpoint.url, method, path, None)
                assert answer.status_code not in (401, 403), f"no key {method} {path}: {answer.status_code}"
    finally:
        open_endpoint.stop()


@needs_model
def test_a_tenants_priority_header_counts_only_as_far_as_granted(engine, monkeypatch):
    settings, scheduler_engine, tenants = engine
    futures = scheduler_engine.scheduler.futures
    endpoint = keyed(settings, scheduler_engine, tenants, monkeypatch)

    def ask(who: str, priority: str | None) -> tuple[int, str | None]:
        """(the priority the scheduler's record holds, X-KVBridge-Priority-Applied)."""
        headers = {"Authorization": f"Bearer {KEYS[who]}"}
        if priority is not None:
            headers["X-KVBridge-Priority"] = priority
        before = len(futures)
        answer = requests.post(endpoint.url + "/v1/completions", headers=headers, timeout=120,
                               json={"model": "x", "prompt": "The word is banana. The word is", "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        assert len(futures) == before + 1
        return futures[-1].result(60).priority, answer.headers.get("X-KVBridge-Priority-Applied")

    try:
        assert ask("bob", "9") == (5, "5")       # no grant: the header is ignored, and the answer says so
        assert ask("bob", "0") == (5, "5")
        assert ask("bob", None) == (5, None)     # no header: nothing to say
        assert ask("tenant", "9") == (7, "7")    # alice's grant, max_priority 7: cut to it
        assert ask("tenant", "3") == (3, "3")
        assert ask("tenant", None) == (5, None)
    finally:
        endpoint.stop()


def test_the_grant_and_the_router_key_are_checked_at_start(tmp_path):
    path = tmp_path / "tenants.json"
    for grant in (10, -1, "7", 2.5, True):
        path.write_text(json.dumps({"tenants": [{"name": "alice", "key_sha256": key_digest("k"),
                                                 "max_priority": grant}]}))
        with pytest.raises(BadSettings, match=r"KVB_SERVE_TENANTS_FILE=.*tenants\[0\] \(alice\): max_priority"):
            TenantTable.load(path)
    path.write_text(json.dumps({"tenants": [{"name": "alice", "key_sha256": key_digest("k"), "max_priority": 9}]}))
    table = TenantTable.load(path)
    with pytest.raises(BadSettings, match="KVB_SERVE_ROUTER_KEY_ENV.*a tenant's key") as refused:
        table.with_router("k")
    assert "'k'" not in str(refused.value)
    with pytest.raises(BadSettings, match="KVB_SERVE_ROUTER_KEY_ENV.*the operator's"):
        table.with_operator("op").with_router("op")
    router = table.with_router("r").resolve(b"r")
    assert router is not None and router.role == "router" and router.priority(9) == 5
    problems = Settings.from_env(env={"KVB_SERVE_ROUTER_KEY_ENV": "sk-not a name"}, env_file=empty_env(tmp_path)).validate({})
    assert any("KVB_SERVE_ROUTER_KEY_ENV must be the NAME" in p for p in problems), problems
    assert not any("sk-not a name" in p for p in problems), problems


def empty_env(tmp_path: Path) -> Path:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    return empty
