"""The shipped Grafana dashboard and the metric catalogue: structure, PromQL and names.

Oracles: PromQL is parsed by promql-parser (the Rust parser behind GreptimeDB, not our code); Ray's own
dashboard JSON, shipped inside the installed ray package, defines the template variables ours must
share; the exported names follow Ray's documented export rules (ray_ prefix, _total for counters).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import pytest
import ray

from dashboards import grafana
from dashboards import metrics as m

RAY_DASHBOARDS = Path(ray.__file__).parent / "dashboard" / "modules" / "metrics" / "dashboards"
# Grafana's own and our template variables, set to what Grafana would substitute.
VARIABLE_VALUES = {"$__rate_interval": "1m"}
ROW_KEYWORDS = ("traffic", "latency", "kv cache", "scheduler", "bubble")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(grafana.DASHBOARD_PATH.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def targets(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in all_panels(dashboard) for t in p.get("targets", [])]


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    for var, value in VARIABLE_VALUES.items():
        expr = expr.replace(var, value)
    found = []
    promql_parser.walk(promql_parser.parse(expr),
                       pre_visit=lambda n: found.append(n) if isinstance(n, promql_parser.VectorSelector) else None)
    return found


def test_committed_json_is_what_the_generator_writes(dashboard):
    assert grafana.DASHBOARD_PATH.read_text() == grafana.dashboard_json(), \
        "dashboards/tandem_grafana_dashboard.json is stale: run `python -m dashboards.grafana`"


def test_panel_ids_are_unique_and_rows_cover_the_issue(dashboard):
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    rows = [p["title"].lower() for p in dashboard["panels"] if p["type"] == "row"]
    for keyword in ROW_KEYWORDS:
        assert any(keyword in r for r in rows), (keyword, rows)
    for panel in all_panels(dashboard):
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_panels_do_not_overlap(dashboard):
    cells = set()
    for panel in all_panels(dashboard):
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps at {(x, y)}"
                cells.add((x, y))


def test_every_query_parses_and_references_exported_series_with_ray_filters(dashboard):
    exported = m.exported_series()
    for title, expr in targets(dashboard):
        found = selectors(expr)
        assert found, (title, expr)
        for s in found:
            assert s.name in exported, f"{title}: {s.name} is not a series Tandem exports"
            labels = {matcher.name: matcher.value for matcher in s.matchers.matchers}
            assert labels.get("SessionName") == "$SessionName" and labels.get("ray_io_cluster") == "$Cluster", \
                (title, expr)


def test_every_metric_in_the_catalogue_has_a_panel(dashboard):
    used = {s.name for _, expr in targets(dashboard) for s in selectors(expr)}
    unused = [spec.name for spec in m.ALL_METRICS if not set(spec.series) & used]
    assert not unused, f"metrics no panel shows: {unused}"


def test_template_variables_match_rays_own_dashboards(dashboard):
    ours = {v["name"]: v for v in dashboard["templating"]["list"]}
    ray_vars = {}
    for name in ("default_grafana_dashboard_base.json", "serve_grafana_dashboard_base.json"):
        for v in json.loads((RAY_DASHBOARDS / name).read_text())["templating"]["list"]:
            ray_vars.setdefault(v["name"], v)
    for name in ("datasource", "SessionName", "Cluster"):
        assert name in ours and name in ray_vars, name
        assert ours[name]["type"] == ray_vars[name]["type"]
        assert ours[name].get("allValue") == ray_vars[name].get("allValue")
    assert ours["datasource"]["query"] == ray_vars["datasource"]["query"] == "prometheus"
    for name, label in (("SessionName", "SessionName"), ("Cluster", "ray_io_cluster")):
        assert ray_vars[name]["query"]["query"].endswith(f", {label})")  # Ray's variable reads this label
        [s] = selectors(ours[name]["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0])
        assert s.name in m.exported_series() and ours[name]["query"]["query"].endswith(f", {label})")


def test_exported_names_follow_rays_export_rules():
    assert m.REQUESTS.exported == "ray_tandem_requests_total"
    assert m.PREEMPTIONS.exported == "ray_tandem_preemptions_total"  # a gauge: no second suffix
    assert m.TTFT.series == ("ray_tandem_time_to_first_token_seconds_bucket",
                             "ray_tandem_time_to_first_token_seconds_sum",
                             "ray_tandem_time_to_first_token_seconds_count",
                             "ray_tandem_time_to_first_token_seconds_total")  # the exact-sum companion
    m.check_catalog()


@pytest.mark.parametrize("bad", [
    m.MetricSpec("tandem:bad", "gauge", "colon"),
    m.MetricSpec("tandem_x", "gauge", "reserved label", ("replica",)),
    m.MetricSpec("tandem_x", "histogram", "unsorted", (), (1.0, 0.5)),
    m.MetricSpec("tandem_x", "gauge", "buckets on a gauge", (), (1.0,)),
    m.MetricSpec("tandem_x", "total", "total without _total"),
])
def test_check_catalog_rejects_specs_ray_would_drop(bad):
    with pytest.raises(ValueError):
        m.check_catalog((bad,))


def test_docs_name_exactly_the_catalogued_metrics():
    docs = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    named = set(re.findall(r"\bray_tandem_\w+", docs))
    known = m.exported_series() | {spec.exported for spec in m.ALL_METRICS}  # histograms by their base name
    assert named <= known, f"docs/operations.md names unknown series: {sorted(named - known)}"
    missing = [spec.exported for spec in m.ALL_METRICS if spec.exported not in named]
    assert not missing, f"docs/operations.md does not list: {missing}"
