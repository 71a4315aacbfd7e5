"""What /metrics exports: every series labelled with its model and version (two versions kept
apart, an unloaded one's series gone), counters for what only grows (``rate()`` needs them), and
docs/observability.md's metrics table naming every family with its type and labels."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from serving.metrics.series import Metrics, ModelMetrics
from serving.telemetry.batch_record import BatchRecord
from shards.pipeline.health import Health
from tests.metrics_text import metric

METRICS_DOC = (Path(__file__).resolve().parents[3] / "docs" / "observability.md").read_text()
BATCH = {"size": 2, "padded_size": 2, "reason": "full", "queue_wait_s": 0.0, "run_s": 0.0}


def exported(metrics: Metrics) -> dict[str, str]:
    """Family name as scraped (``_total`` included for counters) -> Prometheus type."""
    text = metrics.render().decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))


# The server's own family (its background tasks' errors), not a version's.
SERVER_WIDE = "shardserve_background_errors"


def samples(metrics: Metrics) -> list[tuple[str, dict[str, str], float]]:
    text = metrics.render().decode()
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def version_samples(metrics: Metrics) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the versions' series (the server's own left out)."""
    return [s for s in samples(metrics) if not s[0].startswith(SERVER_WIDE)]


def fill(model: ModelMetrics, *, calls: int = 7) -> None:
    """One of everything: a request, a reject, a batch, gauges, health and a stage's stats."""
    model.observe_latency(200, 0.01)
    model.reject("queue_full")
    model.observe_batch(BatchRecord(**BATCH, ok=True, isolated=1))
    model.bind_gauges(lambda: 3.0, lambda: 1.0, lambda: 2.0)
    model.bind_health(lambda: Health(replicas=1, healthy=1, states=("healthy",)))
    model.bind_state(lambda: "READY", ("LOADING", "READY"))
    model.scale_event("up", "queue_wait")
    model.rollback("errors")
    generation = model.generation()
    generation.observe_step("prefill", 2)
    generation.observe_first_token(0.2, "high")
    generation.observe_queue_wait(0.1, "low")
    generation.observe_preemption("low")
    generation.observe_refusal("low")
    generation.observe_token_gap(0.05)
    generation.observe_tokens(2)
    model.bind_generation(lambda: 2.0, lambda: 6.0, {"high": lambda: 0.0, "low": lambda: 3.0})
    model.set_stage_stats(
        [
            {
                "replica": 0,
                "stage_index": 1,
                "calls": calls,
                "compute_seconds_total": 0.25,
                "memory": {"planned_peak_bytes": 10, "rss_bytes": 20, "rss_peak_bytes": 30},
            }
        ]
    )


def full_metrics() -> Metrics:
    metrics = Metrics()
    fill(metrics.for_model("m", "1"))
    return metrics


def test_stage_calls_and_compute_seconds_are_counters() -> None:
    metrics = full_metrics()
    text = metrics.render().decode()

    labels = {"model": "m", "version": "1", "replica": "0", "stage": "1"}
    assert metric(text, "shardserve_stage_calls_total", **labels) == 7.0
    assert metric(text, "shardserve_stage_compute_seconds_total", **labels) == 0.25
    types = exported(metrics)
    assert types["shardserve_stage_calls_total"] == "counter"
    assert types["shardserve_stage_compute_seconds_total"] == "counter"
    assert "shardserve_stage_calls" not in types
    assert "shardserve_stage_compute_seconds" not in types


def test_every_series_carries_its_model_and_version_and_two_versions_stay_apart() -> None:
    metrics = Metrics()
    fill(metrics.for_model("a", "1"), calls=5)
    fill(metrics.for_model("a", "2"), calls=9)

    found = version_samples(metrics)
    unlabelled = [(name, labels) for name, labels, _ in found if "model" not in labels]
    assert unlabelled == []
    families = {name for name, _, _ in found}
    for version in ("1", "2"):
        mine = {name for name, labels, _ in found if labels["version"] == version}
        assert mine == families  # each version has every series of its own
    calls = {
        labels["version"]: value
        for name, labels, value in found
        if name == "shardserve_stage_calls_total"
    }
    assert calls == {"1": 5.0, "2": 9.0}
    assert metrics.for_model("a", "2") is metrics.for_model("a", "2")


def test_remove_model_drops_its_series_and_a_draining_request_does_not_bring_them_back() -> None:
    metrics = Metrics()
    gone = metrics.for_model("a", "1")
    fill(gone)
    fill(metrics.for_model("b", "1"))

    metrics.remove_model("a", "1")
    gone.observe_latency(503, 0.1)  # new labels after the unload
    gone.reject("shutting_down")
    gone.observe_batch(BatchRecord(**BATCH, ok=False))
    gone.set_stage_stats([{"replica": 0, "stage_index": 0, "calls": 1}])

    models = {labels["model"] for _, labels, _ in version_samples(metrics)}
    assert models == {"b"}
    again = metrics.for_model("a", "1")  # loaded again later: its series start afresh
    again.reject("queue_full")
    value = metrics.registry.get_sample_value(
        "shardserve_rejects_total", {"model": "a", "version": "1", "reason": "queue_full"}
    )
    assert value == 1.0


def test_every_exported_metric_is_in_the_docs_table_with_its_type_and_labels() -> None:
    rows = re.findall(r"^\| `(shardserve_\w+)` \| (\w+) \| ([^|]*) \|", METRICS_DOC, re.MULTILINE)
    documented = {name: (kind, re.findall(r"`(\w+)`", labels)) for name, kind, labels in rows}
    exported_labels: dict[str, set[str]] = {}
    for name, labels, _ in samples(full_metrics()):
        family = re.sub(r"_(bucket|count|sum|created)$", "", name)
        exported_labels.setdefault(family, set()).update(set(labels) - {"le"})
    # prometheus_client's own ``*_created`` timestamps are not ours to document.
    types = {k: v for k, v in exported(full_metrics()).items() if not k.endswith("_created")}

    assert {name: kind for name, (kind, _) in documented.items()} == types
    for name, (_, labels) in documented.items():
        assert set(labels) == exported_labels[name], name


def test_padded_positions_count_real_and_pad_positions_of_length_padded_batches() -> None:
    metrics = Metrics()
    model = metrics.for_model("m", "1")
    model.observe_batch(BatchRecord(**BATCH, ok=True, positions=23, padded_positions=41))
    model.observe_batch(BatchRecord(**BATCH, ok=True))  # no length padding: counts nothing
    text = metrics.render().decode()
    labels = {"model": "m", "version": "1"}
    assert metric(text, "shardserve_padded_positions_total", **labels, kind="real") == 23.0
    assert metric(text, "shardserve_padded_positions_total", **labels, kind="pad") == 41.0
    assert exported(metrics)["shardserve_padded_positions_total"] == "counter"
