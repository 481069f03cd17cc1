"""Metrics end to end: a real Ray cluster, real HTTP traffic, Ray's metrics export, and Prometheus.

Oracles: request, status and token counts come from what the test sent (prompt lengths from the tokenizer,
ignore_eos fixes every completion at MAX_TOKENS); the scrape is parsed by prometheus_client's parser; the
dashboard's series are read from the shipped JSON by promql-parser; Prometheus (Debian's package, run
against the config Ray generated for the session) checks the PromQL itself. Where only the engine knows a
number (prefix-cache hits, preemptions), the export is compared with the replica's own stats().
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from transformers import AutoTokenizer

from dashboards import grafana, provision
from dashboards import metrics as m
from engine import DEFAULT_MODEL_DIR
from serve_cluster import free_port, give_up_once_running, serve_cluster, wait_for
from test_dashboard import selectors, targets

MAX_TOKENS = 8
PROMPTS = ["Return a new", "This module provides", "The file object", "Open the file and",
           "If the value is None,", "Convert a string to"]
QUESTIONS = ["What does os.path.join do?", "What does json.dumps do?", "What does str.split do?"]
LONG = "Return the number of items in the container and raise a TypeError when it has no length"
N_GOOD = len(PROMPTS) + len(QUESTIONS) + 2  # + the long prompt twice (prefix-cache hit)
ENGINE = "EngineReplica"


@pytest.fixture(scope="module")
def cluster():
    # the split app: ingress and engine metrics from their own deployments (the colocated app's, from its one
    # replica: tests/test_colocated.py)
    with serve_cluster({"num_replicas": 1, "colocated": False}, metrics=True) as c:
        yield c


@pytest.fixture(scope="module")
def traffic(cluster) -> dict:
    """Send the workload once; return what the server must have counted."""
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    common = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        def completion(prompt):
            r = client.post("/v1/completions", json={"prompt": prompt, **common})
            assert r.status_code == 200, r.text

        def chat(question):
            body = {"messages": [{"role": "user", "content": question}], "stream": True, **common}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()

        with ThreadPoolExecutor(8) as pool:  # concurrent, so steps batch several requests
            list(pool.map(completion, PROMPTS)) + list(pool.map(chat, QUESTIONS))
        completion(LONG)
        completion(LONG)  # after the first finished: its full blocks are in the prefix cache
        assert client.post("/v1/completions", json={"prompt": "x", "temperature": -1}).status_code == 400
        assert client.post("/v1/completions", json={"prompt": "x", "model": "nope"}).status_code == 404
        assert client.get("/v1/no-such-route").status_code == 404
    chat_ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                        tokenize=False) for q in QUESTIONS]
    prompt_tokens = (sum(len(tok.encode(p)) for p in PROMPTS + [LONG, LONG])
                     + sum(len(tok.encode(t, add_special_tokens=False)) for t in chat_ids))
    return {"prompt_tokens": prompt_tokens, "generation_tokens": N_GOOD * MAX_TOKENS}


def scrape(cluster) -> dict[str, list]:
    """Series name -> [(labels, value)] from Ray's metrics export port (Tandem's series only)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_tandem_"):
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(series: dict, name: str, **labels) -> float:
    return sum(v for lab, v in series.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def replica_stats(cluster) -> dict:
    """The engine's own stats() (the app runs one replica)."""
    return serve.get_deployment_handle(ENGINE, cluster.app_name).stats.remote().result(timeout_s=30)


@pytest.fixture(scope="module")
def exported(cluster, traffic) -> dict[str, list]:
    """The scrape once everything sent has been exported and the engine is idle again."""
    def settled():
        s = scrape(cluster)
        done = (total(s, m.REQUESTS.exported) == N_GOOD + 3
                and total(s, m.GENERATION_TOKENS.exported) == traffic["generation_tokens"]
                and total(s, m.E2E.exported + "_count") == 2 * N_GOOD
                and total(s, m.STEP_FORWARD.exported + "_count") == total(s, m.STEPS.exported) > 0
                and total(s, m.RUNNING.exported) == 0
                and total(s, m.KV_USAGE.exported, pool="device") == 0)
        return s if done else None
    return wait_for(settled, timeout_s=90, interval_s=2, what="the traffic to show up in Ray's export")


def test_every_series_the_dashboard_queries_is_exported(exported):
    dashboard = json.loads(grafana.DASHBOARD_PATH.read_text())
    wanted = {s.name for _, expr in targets(dashboard) for s in selectors(expr)}
    assert wanted <= set(exported), f"missing from the scrape: {sorted(wanted - set(exported))}"


def test_request_counts_match_what_was_sent(exported, traffic, cluster):
    name = m.REQUESTS.exported
    assert total(exported, name, status_code="200", finish_reason="length") == N_GOOD
    assert total(exported, name, status_code="200", endpoint="/v1/chat/completions") == len(QUESTIONS)
    assert total(exported, name, status_code="400", finish_reason="error", endpoint="/v1/completions") == 1
    assert total(exported, name, status_code="404", finish_reason="error", endpoint="/v1/completions") == 1
    assert total(exported, name, status_code="404", endpoint="other") == 1
    assert {lab["deployment"] for lab, _ in exported[name]} == {"OpenAIIngress"}
    assert {lab["application"] for lab, _ in exported[name]} == {cluster.app_name}
    assert total(exported, m.PROMPT_TOKENS.exported) == traffic["prompt_tokens"]
    assert total(exported, m.GENERATION_TOKENS.exported) == traffic["generation_tokens"]


def test_latency_histograms_are_populated_per_part(exported):
    per_request = {m.TTFT: N_GOOD, m.E2E: N_GOOD, m.QUEUE_TIME: N_GOOD}
    for spec, n in per_request.items():
        for part in m.PARTS:
            assert total(exported, spec.exported + "_count", part=part) == n, (spec.name, part)
    # Engine ITL: one per token after the first; Serve ITL: one per request.
    assert total(exported, m.ITL.exported + "_count", part="engine") == N_GOOD * (MAX_TOKENS - 1)
    assert total(exported, m.ITL.exported + "_count", part="serve") == N_GOOD
    for spec in (m.TTFT, m.ITL, m.E2E, m.QUEUE_TIME):
        assert_histogram_sane(exported, spec)
    engine_ttft = total(exported, m.TTFT.sum_spec.exported, part="engine")
    assert 0 < engine_ttft <= total(exported, m.E2E.sum_spec.exported, part="engine")


def assert_histogram_sane(exported: dict, spec: m.MetricSpec) -> None:
    buckets: dict[tuple, list] = {}
    for lab, v in exported.get(spec.exported + "_bucket", []):
        key = tuple(sorted((k, x) for k, x in lab.items() if k != "le"))
        buckets.setdefault(key, []).append((float(lab["le"]), v))
    assert buckets, spec.name
    for key, pairs in buckets.items():
        counts = [v for _, v in sorted(pairs)]
        assert counts == sorted(counts), (spec.name, key)  # cumulative
        [count] = [v for lab, v in exported[spec.exported + "_count"]
                   if tuple(sorted((k, x) for k, x in lab.items())) == key]
        assert counts[-1] == count  # +Inf bucket holds them all
    assert all(v >= 0 for _, v in exported[spec.exported + "_sum"])
    assert all(v >= 0 for _, v in exported[spec.sum_spec.exported])
    # the exact-sum companion the dashboards read, for the same label sets as the histogram
    assert {tuple(sorted(lab.items())) for lab, _ in exported[spec.sum_spec.exported]} == \
        {tuple(sorted(lab.items())) for lab, _ in exported[spec.exported + "_sum"]}


def test_engine_state_and_step_metrics(exported, traffic, cluster):
    stats = replica_stats(cluster)
    labels = {lab["deployment"] for lab, _ in exported[m.KV_USAGE.exported]}
    assert labels == {ENGINE}
    assert total(exported, m.KV_BLOCKS.exported, pool="device") == stats["kv_blocks_total"] > 0
    assert total(exported, m.KV_USAGE.exported, pool="device") == 0  # idle: back to zero
    assert total(exported, m.WAITING.exported) == total(exported, m.RUNNING.exported) == 0
    hits = total(exported, m.PREFIX_HITS.exported)
    assert hits == stats["prefix_cache_hit_tokens"] >= 16  # the repeated long prompt
    assert total(exported, m.PREFIX_QUERIED.exported) == stats["prefix_cache_queried_tokens"]
    assert total(exported, m.PREEMPTIONS.exported) == stats["num_preemptions"]
    assert total(exported, m.OFFLOADS.exported) == total(exported, m.SWAP_INS.exported) == 0
    steps = total(exported, m.STEPS.exported)
    for spec in (m.STEP_FORWARD, m.STEP_SAMPLE, m.BATCH_SIZE, m.STEP_TOKENS):
        assert total(exported, spec.exported + "_count") == steps, spec.name
    if stats["num_preemptions"] == 0:
        # Each position is computed once, except cached prompt tokens (skipped) and the decode rows of
        # requests that had already finished when the pipelined step ran (zombies, computed and dropped).
        computed = traffic["prompt_tokens"] + N_GOOD * (MAX_TOKENS - 1) - hits + stats["zombie_rows"]
        assert total(exported, m.STEP_TOKENS.sum_spec.exported) == computed
        assert total(exported, m.STEP_TOKENS.exported + "_sum") == computed  # exact, not a bucket estimate
    periods = total(exported, m.STEP_PERIOD.exported + "_count")
    assert 0 < periods < steps and total(exported, m.STEP_BUSY.exported + "_count") == periods
    assert total(exported, m.STEP_BUSY.exported + "_bucket", le="1.0") == periods  # fractions <= 1
    assert total(exported, m.BATCH_SIZE.exported + "_bucket", le="1.0") < steps  # some steps batched


def test_dashboard_lands_beside_rays_own_in_the_session_provisioning_folder(cluster):
    written = provision.write_to_ray_session(Path(cluster.temp_dir) / "session_latest")
    assert (written.parent / "serve_grafana_dashboard.json").is_file()  # Ray's Serve dashboard
    assert json.loads(written.read_text())["uid"] == grafana.DASHBOARD_UID


# ---- Prometheus ----------------------------------------------------------------------------------------------
def prometheus_binary() -> str:
    """Debian's prometheus, installed here when missing; skip only when it cannot be installed."""
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("prometheus is not installed and cannot be: needs apt-get as root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
    result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0:  # maybe the package lists are missing or stale
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env, timeout=300)
        result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0 or not shutil.which("prometheus"):
        pytest.skip(f"installing Debian's prometheus failed: {(result.stderr or result.stdout)[-500:]}")
    return shutil.which("prometheus")


def private_prometheus_config(cluster, tmp_path: Path) -> Path:
    """Ray's generated config, checked to scrape our export port, with a 1 s scrape interval."""
    session = Path(cluster.temp_dir) / "session_latest"
    config = yaml.safe_load((session / "metrics" / "prometheus" / "prometheus.yml").read_text())
    [sd_file] = [f for job in config["scrape_configs"] for sd in job.get("file_sd_configs", []) for f in sd["files"]]
    sd_targets = [t for group in json.loads(Path(sd_file).read_text()) for t in group["targets"]]
    assert any(t.endswith(f":{cluster.metrics_port}") for t in sd_targets), sd_targets
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def prom_query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(cluster, exported, tmp_path_factory):
    binary = prometheus_binary()
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={private_prometheus_config(cluster, tmp)}",
                             f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp / 'data'}",
                             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).status == 200,
                 timeout_s=30, what="Prometheus to be ready")
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_prometheus_scrapes_an_engine_metric_through_rays_config(prometheus, traffic):
    expr = f"sum({m.GENERATION_TOKENS.exported})"
    result = wait_for(lambda: prom_query(prometheus, expr), timeout_s=30, what=f"Prometheus to return {expr}")
    assert float(result[0]["value"][1]) == traffic["generation_tokens"]


def test_prometheus_answers_every_dashboard_query(prometheus):
    dashboard = json.loads(grafana.DASHBOARD_PATH.read_text())
    values = {"$__rate_interval": "1m", "$SessionName": ".+", "$Cluster": ".*"}
    # rate() needs two samples in its window: wait for a few scrapes of the 1 s interval.
    wait_for(lambda: len(prom_query(prometheus, f"{m.STEPS.exported}[1m]")[0]["values"]) >= 3, timeout_s=30,
             what="three scrapes")
    empty = []
    for title, expr in targets(dashboard):
        for var, value in values.items():
            expr = expr.replace(var, value)
        if not prom_query(prometheus, expr):
            empty.append((title, expr))
    assert not empty, f"panel queries with no data: {empty}"


# ---- last: more traffic (the fixtures above have their snapshot) -----------------------------------------------
def test_client_disconnects_are_counted_499_abort_never_5xx(cluster, exported):
    """A client that leaves a stream, and one that gives up on a whole response, are 499 / abort."""
    name = m.REQUESTS.exported
    body = {"prompt": "Return the", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 4:
                    break
    # a response the client gives up on: the longest the embedded model's 1024-token context allows. The client
    # leaves once the engine is running the request. (It used to leave after a fixed 0.1 s; on a loaded host that
    # once counted one disconnect of the two, most likely a request still in Serve's proxy, which no part of the
    # app had seen.) The stream above is aborted first, so a running request is this one.
    wait_for(lambda: replica_stats(cluster).num_running == 0, 60, 0.05, what="the left stream's abort")
    asyncio.run(give_up_once_running(cluster, {**body, "max_tokens": 1000},
                                     lambda: replica_stats(cluster).num_running > 0))
    # the event itself: both counted and exported (Ray's export runs every few seconds; a slow host takes longer)
    counted = wait_for(lambda: total(scrape(cluster), name, status_code="499") == 2 or None, timeout_s=180,
                       interval_s=2, what="both disconnects to be exported")
    s = scrape(cluster)
    assert counted and total(s, name, status_code="499", finish_reason="abort") == 2
    assert not [lab for lab, v in s[name] if lab["status_code"].startswith("5") and v > 0]
