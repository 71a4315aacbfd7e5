"""A stage actor's GPU memory limit, from its plan: the TensorFlow side of sharing a device.

Two stage actors (or two parts of a split layer) given fractions of one GPU both see the whole
device; with memory growth alone the first to grow takes what the second planned on. Each actor
instead caps its TensorFlow allocator at its stage's planned peak (weights + activations +
overhead, ``StageSpec.planned_peak_bytes``) times a margin, set as a logical device before
TensorFlow initialises the GPU in that process. No plan (a SavedModel served whole), the limit
turned off, or no GPU: memory growth as before.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)

# Planned peak x this: the plan counts weights and the worst live activations, not TensorFlow's
# workspace (cuDNN, XLA scratch), fragmentation, or a batch padded past the planned rows.
GPU_MEMORY_MARGIN = 1.25
# Below this TensorFlow cannot even hold its CUDA context's workspace.
MIN_LIMIT_MIB = 64

_MIB = 1 << 20
_logged_no_gpu = False


def gpu_memory_limit_mib(planned_peak_bytes: int, margin: float = GPU_MEMORY_MARGIN) -> int:
    """The allocator cap for a stage planned at ``planned_peak_bytes``, in whole MiB."""
    if planned_peak_bytes < 0 or margin < 1.0:
        raise ValueError(
            f"planned_peak_bytes must be >= 0 and margin >= 1, got {planned_peak_bytes}, {margin}"
        )
    return max(MIN_LIMIT_MIB, math.ceil(planned_peak_bytes * margin / _MIB))


def limit_gpu_memory(tf: Any, gpus: list[Any], limit_mib: int | None) -> int | None:
    """Cap ``gpus`` (TensorFlow's physical GPUs of this process, before it initialised them) at
    ``limit_mib`` each, or let them grow where no limit is given. Returns the limit applied.

    With no GPU listed it does nothing, and says so once per process."""
    global _logged_no_gpu
    if not gpus:
        if limit_mib is not None and not _logged_no_gpu:
            _logged_no_gpu = True
            log.info(
                "no GPU in this stage actor: its planned memory limit (%d MiB) is not set",
                limit_mib,
            )
        return None
    if limit_mib is None:
        # Growth lets fractional shards share one device instead of the first taking it all.
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        return None
    # A logical device with a memory limit and memory growth exclude each other in TensorFlow.
    config = [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mib)]
    for gpu in gpus:
        tf.config.set_logical_device_configuration(gpu, config)
    log.info(
        "stage actor GPU memory limited to %d MiB per device (planned peak x %.2f)",
        limit_mib,
        GPU_MEMORY_MARGIN,
    )
    return limit_mib
