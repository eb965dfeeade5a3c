"""The Grafana dashboard (``deploy/grafana/kvbridge.json``) and the Prometheus alerting rules
(``deploy/prometheus/kvbridge-rules.yml``) use only metrics and labels kvbridge exports.

What is exported is read from the code, not from its text:

- the relay's metrics from a real :class:`~kvbridge.adapters.relay.Relay` that has been fed
  the bundled sample and one undecodable payload, rendered in Prometheus' text format by
  ``prometheus_client`` and parsed back;
- the router's from a :class:`~kvbridge.ray_integration.router_metrics.RouterMetrics` instance: each
  Ray metric's name and tag keys, named as Ray's metrics agent exports them (its namespace
  ``ray_`` in front; a histogram as ``_bucket``, ``_sum`` and ``_count``; checked against a
  real Ray 2.60 agent when this test was written).

Every PromQL expression of the dashboard (template variables substituted) and of the rules is
then taken apart: each metric it names must be exported, and each label it matches on, groups
by or joins on must be a label of one of its metrics (or ``instance``/``job``, which Prometheus
adds). ``promtool`` (Debian's ``prometheus`` package) checks that the rules and every dashboard
expression parse and runs the rules' unit tests (``kvbridge-rules.test.yml``); without it those
checks are skipped, saying so, and only the YAML is parsed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.adapters.capture import CaptureReader
from kvbridge.adapters.pipeline import record_source
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.relay_metrics import METRICS, metrics_registry
from kvbridge.adapters.source import Source, StreamReset

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvbridge.json"
RULES = ROOT / "deploy" / "prometheus" / "kvbridge-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvbridge-rules.test.yml"
SAMPLE = ROOT / "kvbridge" / "data" / "sample.kvcap"

SCRAPE_LABELS = frozenset(("instance", "job"))
"""Labels Prometheus adds to every scraped series."""
PROMETHEUS_OWN = {"up": frozenset()}

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning"  # pydantic's, from Ray Serve's import by kvbridge.ray_integration
)
"""Series Prometheus makes itself."""

Exported = dict[str, frozenset[str]]
"""``{series name: its label names}``."""


# --------------------------------------------------------------------------- what is exported


def relay_metrics(tmp_path: Path) -> tuple[Exported, dict[str, dict[str, set[str]]]]:
    """The series a relay exports, with their label names and the label values seen, once it
    has been fed the sample, an undecodable payload and an engine restart (every family then
    has samples)."""
    sources = [Source(f"ipc://{tmp_path}/worker-{worker}", worker_id=worker) for worker in (1, 2)]
    records = list(CaptureReader(SAMPLE))
    with Relay(sources, block_size=4) as relay:
        for record in records:
            relay.pipeline.feed_record(record)
        relay.pipeline.feed_batch(sources[0], b"\xc1 not msgpack", 99)  # a bad frame
        relay.pipeline.feed_reset(StreamReset(record_source(records[0]), "restart"))  # a clear
        text = generate_latest(metrics_registry(relay=relay)).decode()
    names: dict[str, set[str]] = {}
    values: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
            for label, value in sample.labels.items():
                values.setdefault(sample.name, {}).setdefault(label, set()).add(value)
    return {name: frozenset(labels) for name, labels in names.items()}, values


def router_metrics() -> Exported:
    """The series the router's Ray metrics become in Prometheus."""
    from ray._private.telemetry.open_telemetry_metric_recorder import NAMESPACE
    from ray.util.metrics import Counter, Histogram

    from kvbridge.ray_integration.router_metrics import RouterMetrics

    exported: Exported = {}
    for metric in vars(RouterMetrics("app#deployment")).values():
        name, tags = f"{NAMESPACE}_{metric.info['name']}", frozenset(metric.info["tag_keys"])
        if isinstance(metric, Histogram):
            exported[name + "_bucket"] = tags | {"le"}
            exported[name + "_sum"] = tags
            exported[name + "_count"] = tags
        else:
            assert isinstance(metric, Counter)
            exported[name] = tags
    return exported


@pytest.fixture(scope="module")
def relay_exported(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Exported, dict[str, dict[str, set[str]]]]:
    return relay_metrics(tmp_path_factory.mktemp("relay"))


@pytest.fixture(scope="module")
def exported(relay_exported: tuple[Exported, dict[str, dict[str, set[str]]]]) -> Exported:
    return {**relay_exported[0], **router_metrics(), **PROMETHEUS_OWN}


def test_every_relay_metric_is_exported(
    relay_exported: tuple[Exported, dict[str, dict[str, set[str]]]],
) -> None:
    """The relay's own table (README, ``METRICS``) and what it really exports agree."""
    names, _ = relay_exported
    assert set(names) == set(METRICS)
    assert names["kvbridge_blocks_total"] == {"worker", "type", "tier", "outcome"}
    assert names["kvbridge_resident_blocks"] == {"worker", "dp_rank", "tier"}
    assert names["kvbridge_stream_suspended"] == {"worker", "endpoint"}
    assert names["kvbridge_progress_age_seconds"] == set()


def test_router_metrics_as_ray_exports_them() -> None:
    assert router_metrics() == {
        "ray_kvbridge_router_decisions_total": {"deployment", "outcome"},
        "ray_kvbridge_router_fallbacks_total": {"deployment", "reason"},
        "ray_kvbridge_router_decision_seconds_bucket": {"deployment", "le"},
        "ray_kvbridge_router_decision_seconds_sum": {"deployment"},
        "ray_kvbridge_router_decision_seconds_count": {"deployment"},
        "ray_kvbridge_router_overlap_blocks_bucket": {"deployment", "tier", "le"},
        "ray_kvbridge_router_overlap_blocks_sum": {"deployment", "tier"},
        "ray_kvbridge_router_overlap_blocks_count": {"deployment", "tier"},
        "ray_kvbridge_router_token_checks_total": {"deployment", "outcome"},
        "ray_kvbridge_router_relays_replaced_total": {"deployment"},
    }


# --------------------------------------------------------------------------- what is used

TEMPLATE = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$worker": ".*",
    "$deployment": ".*",
}
KEYWORDS = frozenset(
    ("and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
     "bool", "offset", "inf", "nan")
)  # fmt: skip


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query["query"])
            assert match, query
            exprs.append(f"count by ({match[2]}) ({match[1]})")
    out = []
    for expr in exprs:
        for variable, value in TEMPLATE.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        out.append(expr)
    return out


def rule_expressions() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


class Usage:
    """The metrics, matchers and grouping labels of one PromQL expression."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.matchers: list[tuple[str, str, str, str]] = []
        """``(metric, label, operator, value)``."""
        self.grouping: set[str] = set()
        text = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
        for clause in re.finditer(
            r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text
        ):
            self.grouping.update(label.strip() for label in clause[2].split(",") if label.strip())
        text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
        self.metrics: set[str] = set()
        for selector in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}", text):
            for matcher in re.finditer(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', selector[2]):
                self.matchers.append((selector[1] or "", matcher[1], matcher[2], matcher[3]))
        text = re.sub(r"\{[^}]*\}", " ", text)
        text = re.sub(r'"[^"]*"', " ", text)
        for token in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", text):
            name, call = token[1], token[2]
            if not call and name not in KEYWORDS:
                self.metrics.add(name)
        self.metrics.update(metric for metric, *_ in self.matchers if metric)


def usages() -> Iterator[tuple[str, Usage]]:
    for expr in dashboard_expressions():
        yield "dashboard", Usage(expr)
    for expr in rule_expressions():
        yield "rules", Usage(expr)


def test_the_parser_of_expressions() -> None:
    usage = Usage(
        'sum by (tier) (rate(kvbridge_blocks_total{outcome!="forwarded", worker=~".*"}[5m]))'
        " / on (instance) group_left max(kvbridge_lag_seconds) > 1"
    )
    assert usage.metrics == {"kvbridge_blocks_total", "kvbridge_lag_seconds"}
    assert usage.grouping == {"tier", "instance"}
    assert usage.matchers == [
        ("kvbridge_blocks_total", "outcome", "!=", "forwarded"),
        ("kvbridge_blocks_total", "worker", "=~", ".*"),
    ]


def test_dashboard_and_rules_use_only_exported_metrics_and_labels(
    exported: Exported, relay_exported: tuple[Exported, dict[str, dict[str, set[str]]]]
) -> None:
    _, values = relay_exported
    for where, usage in usages():
        assert usage.metrics, (where, usage.expr)
        unknown = usage.metrics - set(exported)
        assert not unknown, f"{where}: {sorted(unknown)} not exported, in {usage.expr}"
        labels = SCRAPE_LABELS.union(*(exported[metric] for metric in usage.metrics))
        assert usage.grouping <= labels, f"{where}: {usage.grouping - labels} in {usage.expr}"
        for metric, label, operator, value in usage.matchers:
            assert label in exported[metric] | SCRAPE_LABELS, (where, metric, label, usage.expr)
            if operator in ("=", "!=") and metric in values and label not in SCRAPE_LABELS:
                assert value in values[metric][label], (where, metric, label, value)


def test_the_dashboard_shows_every_metric(exported: Exported) -> None:
    """Blocks by tier and outcome, drops, gaps, replays, losses, lag, residency, bad frames,
    clears and unknown fields for the relay; decisions, fallbacks, latency and overlap by tier
    for the router: every series family kvbridge exports has a panel."""
    used = set().union(*(Usage(expr).metrics for expr in dashboard_expressions()))
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in exported} - {"up"}
    shown = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    assert families <= shown, families - shown


def test_the_rules_cover_silence_losses_lag_stalls_and_fallbacks() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {rule["alert"]: rule for group in rules["groups"] for rule in group["rules"]}
    assert set(alerts) == {
        "KvbridgeRelayDown",
        "KvbridgeSourceNeverDelivered",
        "KvbridgeSourceSilent",
        "KvbridgeBatchesLost",
        "KvbridgeLagHigh",
        "KvbridgeBadFrames",
        "KvbridgeRelayStalled",
        "KvbridgeStreamSuspended",
        "KvbridgeRouterFallbackRate",
        "KvbridgeRouterSlowDecisions",
    }
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert {"summary", "description"} <= set(rule["annotations"]), name


# --------------------------------------------------------------------------- promtool

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install prometheus); the YAML was parsed "
    "and its metric names checked without it",
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, check=False, timeout=60
    )


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 10 rules found" in result.stdout


@needs_promtool
def test_promtool_runs_the_rules_unit_tests() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    """Each dashboard query, as a recording rule, so that promtool parses its PromQL."""
    exprs = dashboard_expressions()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"kvbridge:dashboard_query_{i}", "expr": expr}
                    for i, expr in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout
