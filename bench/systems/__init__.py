"""One launcher per system under test; each starts a server subprocess serving a ``.keras`` file.

Every server answers ``POST /predict`` with a ``{"instances": [...]}`` body and returns
``{"predictions": [...]}``, so one load generator and one body serve them all.
"""

from __future__ import annotations

from bench.systems.base import LaunchSpec, ServerProcess, SystemConfig
from bench.systems.registry import SYSTEMS, launch_spec

__all__ = ["SYSTEMS", "LaunchSpec", "ServerProcess", "SystemConfig", "launch_spec"]
