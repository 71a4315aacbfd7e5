"""TensorFlow's ``tf.config`` and Ray's GPU ids faked for an actor's set-up, to test the GPU path
without a GPU (``shards.actor.stage_actor._configure_tensorflow``): what is asked of ``tf.config``
is recorded. Only the set-up is faked; the actor's own TensorFlow work runs on the CPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import ray

from shards.actor import gpu_memory, stage_actor

__all__ = ["FakeConfig", "install_fake_tf"]


class FakeConfig:
    """What ``_configure_tensorflow`` asks of ``tf.config``, recorded."""

    def __init__(self, gpus: list[str]) -> None:
        self.gpus = gpus
        self.calls: list[tuple[str, Any, Any]] = []
        self.threading = SimpleNamespace(
            set_intra_op_parallelism_threads=lambda n: None,
            set_inter_op_parallelism_threads=lambda n: None,
        )
        self.experimental = SimpleNamespace(
            set_memory_growth=lambda gpu, on: self.calls.append(("growth", gpu, on))
        )
        self.LogicalDeviceConfiguration = lambda memory_limit: ("limit", memory_limit)

    def list_physical_devices(self, kind: str) -> list[str]:
        return list(self.gpus)

    def set_logical_device_configuration(self, gpu: str, config: Any) -> None:
        self.calls.append(("logical", gpu, config))

    def set_visible_devices(self, devices: Any, kind: str) -> None:
        self.calls.append(("visible", devices, kind))


def install_fake_tf(
    monkeypatch: pytest.MonkeyPatch, gpus: list[str], ray_gpus: list[int]
) -> FakeConfig:
    """``gpus``: the physical GPUs TensorFlow lists; ``ray_gpus``: the ids Ray gave the actor."""
    config = FakeConfig(gpus)
    monkeypatch.setattr(stage_actor, "import_tensorflow", lambda: SimpleNamespace(config=config))
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ray_gpus)
    resources = {"CPU": 1.0, **({"GPU": float(len(ray_gpus))} if ray_gpus else {})}
    context = SimpleNamespace(get_assigned_resources=lambda: resources)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(gpu_memory, "_logged_no_gpu", False)
    return config
