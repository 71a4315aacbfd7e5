"""Launch specs of the peers: LitServe and Ray Serve, with the same batch size and timeout."""

from __future__ import annotations

from bench.systems.base import LaunchSpec, SystemConfig, python_module


def _fixed_timeout_ms(config: SystemConfig) -> str:
    # The peers have no adaptive policy: "auto" means their nearest equivalent, no wait at all.
    return "0" if config.batch_timeout_ms == "auto" else f"{float(config.batch_timeout_ms):g}"


def _peer_spec(name: str, module: str, config: SystemConfig) -> LaunchSpec:
    argv = python_module(
        module,
        "--model",
        str(config.model_path),
        "--port",
        str(config.port),
        "--max-batch-size",
        str(config.max_batch_size),
        "--batch-timeout-ms",
        _fixed_timeout_ms(config),
    )
    return LaunchSpec(name, argv)


def litserve_spec(config: SystemConfig) -> LaunchSpec:
    return _peer_spec("litserve", "bench.systems.litserve_app", config)


def rayserve_spec(config: SystemConfig) -> LaunchSpec:
    return _peer_spec("rayserve", "bench.systems.rayserve_app", config)
