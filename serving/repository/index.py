"""What ``POST /v2/repository/index`` says of each model and version: READY, LOADING or
UNAVAILABLE with why in one line, for those served (``serving.version.readiness``) and those
only on disk (not selected by the policy, unloaded through the API, incomplete, broken)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from serving.repository.source import REMOVED, ModelPlan
from serving.version.readiness import version_state

if TYPE_CHECKING:
    from serving.protocols.contract import IndexEntry
    from serving.repository.registry import Registry
    from serving.version.life import IndexState

__all__ = ["UNLOADED", "index_entries"]

UNLOADED = "unloaded through the repository API"


def index_entries(
    state: Registry,
    plans: dict[str, ModelPlan],
    held: Collection[str],
    note: Callable[[str, str], str],
    ready_only: bool = False,
) -> list[IndexEntry]:
    """Every model the plans or the state know, and each of its versions; ``held``: models
    unloaded through the API; ``note(name, version)``: a served version's rollout note;
    ``ready_only``: only the versions READY in the index's words."""
    entries: list[IndexEntry] = []
    for name in sorted(set(plans) | set(state.models)):
        plan = plans.get(name)
        served = state.models.get(name, {})
        versions = {int(v) for v in served} | set(plan.versions if plan else ())
        if not versions:
            why = (plan.error if plan else None) or "no complete version in the repository"
            entries.append(_entry(name, "", "UNAVAILABLE", why))
        for v in sorted(versions):
            model = served.get(str(v))
            if model is not None:
                found, reason = version_state(model)
                entries.append(_entry(name, str(v), found, reason or note(name, str(v))))
            else:
                why = _why_not(plan, v, unloaded=name in held)
                entries.append(_entry(name, str(v), "UNAVAILABLE", why))
    return [e for e in entries if e["state"] == "READY"] if ready_only else entries


def _why_not(plan: ModelPlan | None, version: int, *, unloaded: bool) -> str:
    if unloaded:
        return UNLOADED
    found = plan.versions.get(version) if plan else None
    if plan is None or found is None:
        return REMOVED
    if found.error is not None:
        return found.error
    if version not in plan.selected:
        return f"not selected by its version policy ({plan.policy})"
    return "not loaded yet"


def _entry(name: str, version: str, state: IndexState, reason: str) -> IndexEntry:
    return {"name": name, "version": version, "state": state, "reason": reason}
