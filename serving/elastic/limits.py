"""A version's batching limits: desired values from named sources, combined by one pure function
and written by one function.

A version's batcher starts with limits sized for the replicas it started with (in-flight batches,
queue rows, pipeline depth: ``serving.version.served.batch_settings``). Three sources may want
them otherwise, each recorded on the version (``serving.version.scale_state.LimitSources``):

- the operator: an admin PUT's fields (``operator_sets``), theirs from then on; a flag
  (``max_inflight_batches``, ``max_queue_rows``) is theirs from the start;
- the replicas that serve now (the scaling loop's observation, a switch replica by replica's
  step): the limits become those a start with that many healthy replicas would have had, so a
  new replica gets batches to run and a removed one's share is not queued for the rest;
- a switch of the version's model: its queue rows widened while another version loads
  (``serving.repository.switch_queue``).

``desired_limits`` combines them (pure: the sources in, the limits out), and ``apply_limits`` is
the only code that changes a served version's batcher settings: no source guesses whether another
changed the value since.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serving.settings.config import Settings, default_queue_rows
from serving.version.scale_state import LimitSources

if TYPE_CHECKING:
    from serving.batching.settings import BatchSettings
    from serving.version.served import ServedModel

__all__ = ["apply_limits", "desired_limits", "follow_replicas", "operator_sets"]


def desired_limits(settings: Settings, sources: LimitSources) -> dict[str, Any]:
    """The batching limits the sources want together, as ``BatchSettings`` fields: the
    operator's fields; the in-flight batches and pipeline depth of ``healthy`` replicas (except
    an in-flight limit the operator set); the queue rows of that in-flight limit and batch, never
    below the start-up rows (a request that size was served), times a switch's widening (except
    rows the operator sized)."""
    start = sources.start
    assert start is not None  # a version's limits exist once its batcher does
    wanted = dict(sources.operator)
    stages, healthy = start.pipeline_stages, sources.healthy
    size = wanted.get("max_batch_size", start.max_batch_size)
    inflight = wanted.get("max_inflight_batches", start.max_inflight_batches)
    if healthy is not None:
        n = max(1, healthy)
        wanted["pipeline_depth"] = stages * n
        if settings.max_inflight_batches is None and "max_inflight_batches" not in wanted:
            inflight = settings.inflight_batches(stages, n)
        wanted["max_inflight_batches"] = inflight
    if settings.max_queue_rows is None:
        rows = start.max_queue_rows
        if sources.operator or healthy is not None:
            rows = max(default_queue_rows(size, inflight), rows)
        wanted["max_queue_rows"] = rows * sources.factor
    return wanted


def apply_limits(model: ServedModel, *, force: bool = False) -> BatchSettings | None:
    """The one writer of a version's batching limits: its batcher takes what its sources want
    (``desired_limits``) where that differs from what it has (``force``: in any case, as an
    admin PUT always did); ``ValueError`` where they are not valid together. Nothing before
    its batcher is made."""
    batcher, sources = model.batcher, model.limits
    if batcher is None or sources.start is None:
        return None
    policy = batcher.settings
    wanted = desired_limits(model.settings, sources)
    changes = {k: v for k, v in wanted.items() if getattr(policy, k) != v}
    if changes or force:
        return batcher.reconfigure(**changes)
    return policy


def operator_sets(model: ServedModel, changes: dict[str, Any]) -> BatchSettings | None:
    """The operator's admin PUT: its fields are theirs from now on, and applied at once;
    ``ValueError`` (and nothing changed) where the limits would not be valid."""
    sources = model.limits
    before = dict(sources.operator)
    sources.operator.update(changes)
    try:
        return apply_limits(model, force=True)
    except ValueError:
        sources.operator = before
        raise


def follow_replicas(model: ServedModel, healthy: int) -> None:
    """The replicas that serve now, as the scaling loop or a switch step saw them (a source;
    ``apply_limits`` writes what follows)."""
    model.limits.healthy = healthy
