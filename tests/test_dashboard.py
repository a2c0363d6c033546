"""The Grafana dashboard shipped with the Helm chart (helm/statestore-async/dashboards/statestore-async.json).

It must load in Grafana -- checked against the dashboard JSON model twice: a JSON Schema of the
fields and panel shapes Grafana needs, and a lossless round trip through Grafana's own dashboard
model (``grafana_foundation_sdk``, generated from Grafana's schema), so that no key is misspelled or
unknown -- and every metric its PromQL names must exist on a running daemon: a real daemon serves
puts and commits, ``/metrics`` is scraped and parsed with prometheus_client's parser, and every
expression (panels and template variables) is parsed with a PromQL parser.
"""
from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import promql_parser
import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel
from prometheus_client.parser import text_string_to_metric_families

from statestore_async.ids import StoreId

DASHBOARD = Path(__file__).resolve().parents[1] / "helm" / "statestore-async" / "dashboards" / "statestore-async.json"
DEADLINE = 60.0  # seconds any awaited condition may take on a busy 2-core machine
GRID_COLUMNS = 24

# What Grafana needs of a provisioned dashboard (its JSON model, schemaVersion 36+: panels with a
# grid position, Prometheus targets through the data source variable, template variables).
_DATASOURCE = {"type": "object", "required": ["type", "uid"],
               "properties": {"type": {"const": "prometheus"}, "uid": {"const": "${datasource}"}}}
_GRID_POS = {"type": "object", "required": ["h", "w", "x", "y"], "additionalProperties": False,
             "properties": {"h": {"type": "integer", "minimum": 1},
                            "w": {"type": "integer", "minimum": 1, "maximum": GRID_COLUMNS},
                            "x": {"type": "integer", "minimum": 0, "maximum": GRID_COLUMNS - 1},
                            "y": {"type": "integer", "minimum": 0}}}
_TARGET = {"type": "object", "required": ["refId", "expr", "datasource"],
           "properties": {"refId": {"type": "string", "pattern": "^[A-Z]$"},
                          "expr": {"type": "string", "minLength": 1},
                          "legendFormat": {"type": "string"},
                          "datasource": _DATASOURCE}}
_ROW = {"type": "object", "required": ["id", "type", "title", "gridPos", "collapsed", "panels"],
        "properties": {"id": {"type": "integer", "minimum": 1}, "type": {"const": "row"},
                       "title": {"type": "string", "minLength": 1}, "collapsed": {"type": "boolean"},
                       "gridPos": _GRID_POS, "panels": {"type": "array", "maxItems": 0}}}
_PANEL = {"type": "object",
          "required": ["id", "type", "title", "description", "gridPos", "datasource", "targets", "fieldConfig",
                       "options"],
          "properties": {"id": {"type": "integer", "minimum": 1},
                         "type": {"enum": ["timeseries", "stat"]},
                         "title": {"type": "string", "minLength": 1},
                         "description": {"type": "string", "minLength": 1},
                         "gridPos": _GRID_POS, "datasource": _DATASOURCE,
                         "targets": {"type": "array", "minItems": 1, "items": _TARGET},
                         "fieldConfig": {"type": "object", "required": ["defaults", "overrides"],
                                         "properties": {"defaults": {"type": "object", "required": ["unit"]},
                                                        "overrides": {"type": "array"}}},
                         "options": {"type": "object"}}}
_VARIABLE = {"type": "object", "required": ["name", "type"],
             "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
                            "type": {"enum": ["datasource", "query"]}},
             "if": {"properties": {"type": {"const": "query"}}},
             "then": {"required": ["datasource", "query"],
                      "properties": {"datasource": _DATASOURCE,
                                     "query": {"type": "object", "required": ["query", "refId"]}}},
             "else": {"required": ["query"], "properties": {"query": {"const": "prometheus"}}}}
DASHBOARD_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["uid", "title", "tags", "schemaVersion", "editable", "time", "refresh", "annotations",
                 "templating", "panels"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "time": {"type": "object", "required": ["from", "to"]},
        "refresh": {"type": "string"},
        "annotations": {"type": "object", "required": ["list"], "properties": {"list": {"type": "array"}}},
        "templating": {"type": "object", "required": ["list"],
                       "properties": {"list": {"type": "array", "items": _VARIABLE}}},
        "panels": {"type": "array", "minItems": 1,
                   "items": {"if": {"properties": {"type": {"const": "row"}}}, "then": _ROW, "else": _PANEL}},
    },
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)", var["query"]["query"])
            assert m, f"variable {var['name']}: expected label_values(<selector>, <label>): {var['query']}"
            exprs.append(m.group(1))
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects, parsed as PromQL once Grafana's variables are replaced
    the way Grafana would (a duration for ``$__rate_interval``, a regex for a multi-value variable)."""
    promql = expr.replace("$__rate_interval", "1m")
    promql = re.sub(r"\$[a-zA-Z_][a-zA-Z0-9_]*", ".*", promql)
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(promql), visit)
    return names


# --- the dashboard loads in Grafana --------------------------------------------------------------

def test_dashboard_matches_the_json_model(dashboard):
    jsonschema.validate(dashboard, DASHBOARD_SCHEMA)


def test_dashboard_round_trips_through_grafanas_model(dashboard):
    """Grafana's dashboard model reads every key the dashboard has and writes it back unchanged (it
    adds its defaults): a misspelled or unknown key would be dropped. With the default plugins
    registered, Prometheus targets and the timeseries and stat panels' options and field config are
    read by their own models, not kept as opaque dicts."""
    register_default_plugins()
    model = Dashboard.from_json(dashboard)
    assert model.uid == "statestore-async" and model.schema_version == dashboard["schemaVersion"]
    assert model.panels is not None and len(model.panels) == len(dashboard["panels"])
    for got, src in zip(model.panels, dashboard["panels"], strict=True):
        assert isinstance(got, RowPanel if src["type"] == "row" else Panel), src["title"]
    written = json.loads(json.dumps(model, cls=JSONEncoder))

    def lost(src: Any, out: Any, path: str) -> list[str]:
        if isinstance(src, dict):
            if not isinstance(out, dict):
                return [path]
            return [p for k, v in src.items()
                    for p in ([f"{path}/{k}"] if k not in out else lost(v, out[k], f"{path}/{k}"))]
        if isinstance(src, list):
            if not isinstance(out, list) or len(out) != len(src):
                return [path]
            return [p for i, (a, b) in enumerate(zip(src, out)) for p in lost(a, b, f"{path}[{i}]")]
        return [] if src == out else [f"{path}: {src!r} became {out!r}"]

    assert lost(dashboard, written, "") == []


def test_panels_tile_the_grid(dashboard):
    """Unique ids, one refId per target of a panel, and no two panels on the same grid cells."""
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= GRID_COLUMNS, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{p['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]


def test_variables_used_are_defined(dashboard):
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$\{?([a-zA-Z_][a-zA-Z0-9_]*)", json.dumps(dashboard)))
    used = {u for u in used if not u.startswith("__")}  # Grafana's own: $__rate_interval, $__all
    assert used <= defined, used - defined
    # every panel filters on the job and instance variables, so the selectors at the top apply
    for p in panels(dashboard):
        for t in p["targets"]:
            assert '{job=~"$job", instance=~"$instance"}' in t["expr"], (p["title"], t["expr"])


def test_expressions_parse_and_name_only_daemon_metrics(dashboard):
    for expr in expressions(dashboard):
        names = metric_names(expr)
        assert names and all(n.startswith("statestore_") for n in names), (expr, names)


# --- every metric it names exists on a running daemon --------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """Sample name -> value of one scrape of ``/metrics``, parsed by prometheus_client."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for(condition, what: str):
    deadline = time.monotonic() + DEADLINE
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {DEADLINE:.0f} s waiting for {what}")
        time.sleep(0.05)


def test_every_metric_of_the_dashboard_exists_on_a_daemon(daemon_process, tmp_path, dashboard):
    port = free_port()
    d = daemon_process("--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    with d.client() as c:
        for store in range(2):
            sid = StoreId(f"file://{tmp_path}/root", "dashboard", store)
            ref = None
            for version in range(3):
                with c.open(sid, version) as h:
                    h.put_many([(b"key-%d-%d" % (store, i), b"value-%d" % version) for i in range(100)])
                    ref = h.commit()
            assert ref is not None and c.await_durable(sid, ref, DEADLINE)
        samples = wait_for(lambda: (s := scrape(port))["statestore_uploads_durable_total"] >= 6
                           and s["statestore_upload_lag_seconds"] == 0 and s,
                           "six deltas durable in the metrics, none waiting")
    assert samples["statestore_stores"] == 2
    assert samples["statestore_requests_total"] > 0 and samples["statestore_memory_bytes"] > 0
    # the latency histograms behind the commit latency and commit-to-durable panels have observations
    assert samples["statestore_commit_latency_seconds_count"] == 6
    assert samples["statestore_commit_latency_seconds_sum"] > 0
    assert samples["statestore_upload_durable_seconds_count"] == 6
    assert samples["statestore_upload_durable_seconds_sum"] > 0
    exported = {name for name in samples if name.startswith("statestore_")}
    named = set().union(*(metric_names(e) for e in expressions(dashboard)))
    assert named <= exported, f"the dashboard names metrics no daemon serves: {sorted(named - exported)}"
    # and the dashboard shows every metric the daemon serves
    assert exported <= named, f"metrics on no panel: {sorted(exported - named)}"
