"""Reading a /metrics scrape in tests: a series by name and some of its labels, whatever the
order the exposition writes labels in."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` (``_total``, ``_count`` included) whose labels
    include ``labels``; 0.0 when there is none."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def has_series(text: str, name: str, **labels: str) -> bool:
    return any(
        sample.name == name and labels.items() <= sample.labels.items()
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    )
