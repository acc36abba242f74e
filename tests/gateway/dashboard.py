"""The metric names the Grafana dashboard's PromQL reads, and the names an exposition offers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/raging-dashboard.json"
_PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right",
                           "bool", "and", "or", "unless", "offset"})
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def queries() -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables'."""
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    found = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            found.append(variable["definition"])
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, label names, grouping clauses,
    strings, ranges and keywords left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", text)  # grouping labels
    text = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", text)  # Grafana's variable query
    names = set()
    for match in _IDENTIFIER.finditer(text):
        rest = text[match.end():].lstrip()
        if not rest.startswith("(") and match.group() not in _PROMQL_WORDS:
            names.add(match.group())
    return names


def dashboard_metrics() -> set[str]:
    return {name for expr in queries() for name in metric_names(expr)}


def exposed(text: str) -> dict[str, str]:
    """Every sample name of an exposition (with _bucket, _sum, _count, _total) -> its type."""
    return dict(_sample_types(text))


def _sample_types(text: str) -> Iterator[tuple[str, str]]:
    for family in text_string_to_metric_families(text):
        yield family.name, family.type
        for sample in family.samples:
            yield sample.name, family.type


def missing_from(text: str) -> set[str]:
    """The dashboard's metrics that the exposition lacks."""
    return dashboard_metrics() - set(exposed(text))
