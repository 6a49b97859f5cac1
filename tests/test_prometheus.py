"""A real Prometheus reads KVBridge's series: Debian's `prometheus` (scripts/setup.sh --test installs it) with
the shipped configuration (deploy/prometheus/prometheus.yml: targets moved to free loopback ports, 1 s scrapes
and rule evaluations) scraping a real `kvbridge serve` whose store is a real cache server. A person asks the
same document twice through the openai SDK (a miss, then a restore from the cache server's L1) and
reads back through Prometheus's HTTP API (/api/v1/query): serve's misses by reason and tokens by tier as the
answers' usage reported them, the recording rules' per-tier hit rates (deploy/prometheus/rules.yml) for serve
and the cache server, and the cache server's hit-rate series standing still while KV-event rechecks ask it
about the same chunks. promtool checks the configuration and the rules and runs their unit test.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests
import yaml

from cache_server_helpers import ServerProcess
from conftest import needs_model
from kvbridge.scheduler.exact import safe_reuse
from process_helpers import clean_env, free_port, start_kvbridge, stop, wait_for

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                      reason="Debian's prometheus (prometheus, promtool) is not installed: "
                                             "run scripts/setup.sh --test or apt-get install prometheus")
pytestmark = pytest.mark.timeout(300)
CHUNK = 32
LANDED = 'kvbridge_lookup_hashes_total{purpose="kv_events",result="hit"}'
DOCUMENT = "# Lighthouse log\n\n" + " ".join(
    f"Night {i}: the {['red', 'green', 'white', 'amber'][i % 4]} lamp was checked by keeper {i % 6} at {i % 12} bells."
    for i in range(24))


def promtool(*args: str) -> str:
    done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{done.stdout}{done.stderr}"
    return done.stdout


@needs_prometheus
def test_promtool_passes_the_shipped_configuration_rules_and_their_unit_test():
    assert "SUCCESS" in promtool("check", "config", str(DEPLOY / "prometheus.yml"))
    groups = yaml.safe_load((DEPLOY / "rules.yml").read_text())["groups"]
    rules = [rule["record"] for group in groups for rule in group["rules"]]
    assert f"SUCCESS: {len(rules)} rules found" in promtool("check", "rules", str(DEPLOY / "rules.yml"))
    assert {"kvbridge_serve:tier_hit_rate:ratio_rate5m", "kvbridge_serve:miss_rate:ratio_rate5m",
            "kvbridge_cache_server:tier_hit_rate:ratio_rate5m"} <= set(rules)
    assert "SUCCESS" in promtool("test", "rules", str(DEPLOY / "rules_test.yml"))


def test_only_a_prompts_lookups_feed_the_cache_servers_hit_rate_and_no_client_mints_a_label():
    from kvbridge.cache_server.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.show_tiers(["L1", "L2"])
    metrics.count_lookup(4, ["L1", "L1", "L2"], chunk_tokens=32)                  # a prompt's (the default)
    metrics.count_lookup(4, ["L1", "L1", "L1", "L1"], 32, purpose="kv_events")   # a recheck: all held
    metrics.count_lookup(2, [], 32, purpose="from-a-newer-client")
    tier = {t: metrics.value("kvbridge_lookup_tier_hit_tokens_total", {"tier": t}) for t in ("L1", "L2")}
    assert tier == {"L1": 64, "L2": 32} and metrics.value("kvbridge_lookup_requested_tokens_total") == 128
    assert metrics.value("kvbridge_lookups_total", {"purpose": "other"}) == 1
    assert metrics.value("kvbridge_lookup_hashes_total", {"purpose": "kv_events", "result": "hit"}) == 4
    assert "from-a-newer-client" not in str(list(metrics.registry.collect()))


# -- the live stack: a cache server, serve on it, Prometheus scraping both ------------------------------------


class Prometheus:
    """The `prometheus` binary on a free loopback port, the shipped configuration pointed at `targets`."""

    def __init__(self, tmp: Path, targets: dict[str, str]) -> None:
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(DEPLOY / "rules.yml")]
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tmp / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                          f"--storage.tsdb.path={tmp / 'data'}",
                                          f"--web.listen-address={self.url.removeprefix('http://')}"],
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._ready, "prometheus did not get ready", self.log, self.proc, timeout_s=60)

    def _ready(self) -> bool:
        try:
            return requests.get(self.url + "/-/ready", timeout=2).status_code == 200
        except (requests.ConnectionError, requests.Timeout):   # not listening yet, or busy starting
            return False

    def query(self, expr: str) -> dict[tuple, float]:
        """An instant query's samples: {(label=value, ...) without __name__, job, instance: value}."""
        answer = requests.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", answer
        return {tuple(sorted((k, v) for k, v in sample["metric"].items() if k not in ("__name__", "job", "instance"))):
                float(sample["value"][1]) for sample in answer["data"]["result"]}

    def wait(self, expr: str, ok, what: str, timeout_s: float = 40) -> dict[tuple, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.query(expr)
            if ok(found):
                return found
            assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s: {expr} = {found}"
            time.sleep(0.5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def metric_value(url: str, line_start: str) -> float:
    """A sample of a /metrics text (0 when absent)."""
    for line in requests.get(url, timeout=5).text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Cache server (metrics on), serve on it (no prefix kept resident, so a repeat restores from the cache
    server; KV events on, rechecking every 0.2 s), Prometheus on both; then the two requests."""
    openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements-test.txt)")
    tmp = tmp_path_factory.mktemp("prometheus")
    store_url, cache_metrics_port, serve_port = f"tcp://127.0.0.1:{free_port()}", free_port(), free_port()
    cache = ServerProcess(clean_env(KVB_L2_DIR=str(tmp / "cache-l2"), KVB_CHUNK_SIZE=str(CHUNK),
                                    KVB_L1_BYTES=str(64 << 20), KVB_CACHE_SERVER_PAGE_BYTES=str(64 << 10)),
                          store_url, args=["--metrics-port", str(cache_metrics_port)], log_path=tmp / "cache.log")
    serve_log, serve, prometheus = tmp / "serve.log", None, None
    try:
        serve = start_kvbridge(["serve"], clean_env(
            KVB_SERVE_PORT=str(serve_port), KVB_STORE_URL=store_url, KVB_CHUNK_SIZE=str(CHUNK),
            KVB_L2_DIR=str(tmp / "serve-l2"), KVB_OUTPUT_DIR=str(tmp / "output"), KVB_CTX_SIZE="1024",
            KVB_SCHED_KV_CELLS="2048", KVB_SCHED_MAX_RUNNING="1", KVB_SCHED_CACHED_PREFIXES="0",
            KVB_SERVE_MAX_TOKENS="4", KVB_KV_EVENTS_URL="tcp://127.0.0.1:0", KVB_KV_EVENTS_CHECK_S="0.2"),
            serve_log)
        wait_for(lambda: "KVBridge serve ready on" in serve_log.read_text(), "serve did not get ready", serve_log,
                 serve, timeout_s=180)
        prometheus = Prometheus(tmp, {"kvbridge_serve": f"127.0.0.1:{serve_port}",
                                      "kvbridge_cache_server": f"127.0.0.1:{cache_metrics_port}"})
        # both targets scraped once before any request: every counter's first sample is its 0
        prometheus.wait("count(up == 1)", lambda r: r.get(()) == 2, "both targets up in Prometheus")
        cache_metrics = f"http://127.0.0.1:{cache_metrics_port}/metrics"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        answers = []
        for attempt in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="kvbridge", max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": f"{DOCUMENT}\n\nWho checked the amber lamp on night 3?"}])
            answers.append((raw.headers.get("x-kvbridge-miss"), raw.parse().usage))
            if attempt == 0:   # the first answer's KV reaches the cache server behind the answer: the writer
                # asks what landed once put_many returned (a KV-events lookup), and a hit there means it did
                wait_for(lambda: metric_value(cache_metrics, LANDED) > 0, "the first prompt's KV stored in the "
                         "cache server", serve_log, serve, timeout_s=30)
        yield {"prometheus": prometheus, "answers": answers}
    finally:
        if prometheus is not None:
            prometheus.close()
        code = stop(serve) if serve is not None else 0
        cache.terminate()
        cache.close()
    assert code == 0, serve_log.read_text()[-3000:]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def same_samples(found: dict, expected: dict) -> bool:
    return found.keys() == expected.keys() and all(close(found[k], v) for k, v in expected.items())


@needs_prometheus
@needs_model
def test_prometheus_reads_serve_misses_by_reason_and_hits_by_tier_as_the_answers_reported(stack):
    (miss, first), (hit, second) = stack["answers"]
    assert (miss, hit) == ("none_stored", "hit"), stack["answers"]
    assert first.prompt_tokens_details.cached_tokens == 0
    reused = second.prompt_tokens_details.cached_tokens
    # serve runs exact mode by default: the rest of the prompt prefills as a solo run would from its cut
    assert reused >= safe_reuse(first.prompt_tokens - 1, first.prompt_tokens), stack["answers"]
    prom = stack["prometheus"]
    total = first.prompt_tokens + second.prompt_tokens
    prom.wait("kvbridge_serve_prompt_tokens_total", lambda r: r.get(()) == total, "both prompts scraped")
    hits = prom.query("kvbridge_serve_hit_tokens_total > 0")
    assert hits == {(("tier", "L1"),): reused}, "every reused token came from the cache server's L1"
    misses = prom.query("kvbridge_serve_misses_total > 0")
    assert misses == {(("reason", "none_stored"),): 1.0}
    miss_tokens = prom.query('kvbridge_serve_miss_tokens_total{reason="none_stored"}')
    assert miss_tokens == {(("reason", "none_stored"),): first.prompt_tokens}


@needs_prometheus
@needs_model
def test_the_recording_rules_give_serve_and_the_cache_server_a_per_tier_hit_rate(stack):
    """Every series a rule reads exists at 0 from the first scrape, so over a window holding all of them the
    rate ratio is exactly the ratio of what was counted: reused tokens over prompt tokens."""
    (_, first), (_, second) = stack["answers"]
    reused, total = second.prompt_tokens_details.cached_tokens, first.prompt_tokens + second.prompt_tokens
    prom = stack["prometheus"]
    serve_rate = prom.wait("kvbridge_serve:tier_hit_rate:ratio_rate5m",
                           lambda r: close(r.get((("tier", "L1"),), -1), reused / total), "serve's L1 hit rate")
    assert same_samples(serve_rate, {(("tier", tier),): (reused / total if tier == "L1" else 0.0)
                                     for tier in ("context", "L1", "L2", "L3")}), serve_rate
    prom.wait('kvbridge_serve:miss_rate:ratio_rate5m{reason="none_stored"}',
              lambda r: close(r.get((("reason", "none_stored"),), -1), first.prompt_tokens / total),
              "serve's none_stored miss rate")
    whole = (first.prompt_tokens // CHUNK) * CHUNK   # the second prompt's lookup found all its whole chunks in L1
    # each prompt's one lookup asked its whole chunks; the writer's checks and the rechecks are not counted
    assert prom.query('kvbridge_lookup_tier_hit_tokens_total{tier="L1"}') == {(("tier", "L1"),): whole}
    assert prom.query("kvbridge_lookup_requested_tokens_total") == {(): 2 * whole}
    server_rate = prom.wait("kvbridge_cache_server:tier_hit_rate:ratio_rate5m",
                            lambda r: close(r.get((("tier", "L1"),), -1), 0.5), "the cache server's L1 hit rate")
    assert same_samples(server_rate, {(("tier", "L1"),): 0.5, (("tier", "L2"),): 0.0}), server_rate


@needs_prometheus
@needs_model
def test_kv_event_rechecks_stay_out_of_the_cache_servers_hit_rate(stack):
    """KV events recheck every 0.2 s that the store still holds the chunks they announced: lookups of the same
    hashes a prompt restores, which would read as hits. They are counted by purpose, the hit rate stands."""
    prom = stack["prometheus"]
    prompt_lookups = prom.query('kvbridge_lookups_total{purpose="prompt"}')
    requested = prom.query("kvbridge_lookup_requested_tokens_total")
    rechecks = prom.query('kvbridge_lookups_total{purpose="kv_events"}')[(("purpose", "kv_events"),)]
    prom.wait('kvbridge_lookups_total{purpose="kv_events"}', lambda r: r[(("purpose", "kv_events"),)] >= rechecks + 5,
              "five more rechecks", timeout_s=30)
    assert prom.query("kvbridge_lookup_requested_tokens_total") == requested
    assert prom.query('kvbridge_lookups_total{purpose="prompt"}') == prompt_lookups == {(("purpose", "prompt"),): 2}
    assert prom.query('kvbridge_lookups_total{purpose="store"} > 0'), "the writer's checks are counted apart too"
