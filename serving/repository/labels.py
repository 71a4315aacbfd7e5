"""A model's labels (``Registry.labels``): those of its ``config.toml``, each pointing only at
a READY version (``ServedModel.takes_requests``; one that cannot is left unset and logged once),
and, for a model with a canary (``serving.canary.controller``), ``stable`` and ``canary``
following the versions in those roles: they win over the ``config.toml`` labels of the same name
(logged once where they differ)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from serving.version.readiness import version_state

if TYPE_CHECKING:
    from serving.repository.registry import Registry
    from serving.repository.source import ModelPlan

__all__ = ["Labels"]

log = logging.getLogger("shardserve")


class Labels:
    def __init__(self, state: Registry) -> None:
        self.state = state
        # (name, label) -> why it was last left unset, or what it clashed with: logged once
        self._notes: dict[tuple[str, str], str] = {}

    def set(self, name: str, plan: ModelPlan | None, roles: dict[str, str | None]) -> None:
        """Point the model's labels at the versions ``plan`` and the ``roles`` name now."""
        served = self.state.models.get(name, {})
        labels: dict[str, str] = {}
        for label, v in (plan.labels if plan else {}).items():
            if label in roles:
                self._clash(name, label, str(v), roles[label])
                continue
            model = served.get(str(v))
            found, reason = version_state(model) if model is not None else ("", "")
            # READY in the state machine, whatever its replicas' condition: the labels are set
            # again on every tick, and a replica being rebuilt must not turn a label's request
            # into a 404 (it gets the 503 that says why).
            if model is not None and model.takes_requests:
                labels[label] = str(v)
                self._notes.pop((name, label), None)
                continue
            why = "is not loaded" if model is None else f"is {found} ({reason})"
            loading = model is not None and model.phase == "loading"
            if self._notes.get((name, label)) != why and not loading:
                log.warning("model %r: label %r left unset: version %d %s", name, label, v, why)
            self._notes[(name, label)] = why
        labels.update({label: v for label, v in roles.items() if v is not None and v in served})
        if labels:
            self.state.labels[name] = labels
        else:
            self.state.labels.pop(name, None)

    def _clash(self, name: str, label: str, configured: str, role: str | None) -> None:
        why = f"role {role}"
        if configured == role or self._notes.get((name, label)) == why:
            return
        self._notes[(name, label)] = why
        now = "is unset: there is no canary" if role is None else f"points at version {role}"
        log.warning(
            "model %r: label %r follows the %s role and %s, not version %s as its config.toml says",
            name,
            label,
            label,
            now,
            configured,
        )
