"""Telling a batch's fault from a replica's, and the watchdog's limit (no Ray cluster needed)."""

from __future__ import annotations

import pytest
import ray.exceptions as rex

from shards.errors import ModelError, ReplicaLostError, StageTimeoutError
from shards.pipeline.faults import is_replica_fault, translate
from shards.pipeline.watchdog import Watchdog


class InvalidArgumentError(Exception):
    pass


class ResourceExhaustedError(Exception):
    pass


def _task_error(cause: BaseException) -> rex.RayTaskError:
    trace = 'Traceback (most recent call last):\n  File "actor.py", line 1\n(pid=7, ip=10.0.0.2)'
    return rex.RayTaskError("ShardActor.forward", trace, cause)


def test_the_model_raising_on_bad_input_is_the_batchs_fault() -> None:
    error = translate(_task_error(InvalidArgumentError("indices[0,2] = 1000 is not in [0, 10)")))
    assert isinstance(error, ModelError) and error.input_blamed
    assert error.message == "InvalidArgumentError: indices[0,2] = 1000 is not in [0, 10)"
    assert not is_replica_fault(error)


def test_an_out_of_memory_error_is_not_blamed_on_the_input() -> None:
    error = translate(_task_error(ResourceExhaustedError("OOM when allocating")))
    assert isinstance(error, ModelError) and not error.input_blamed


def test_a_dead_stage_is_the_replicas_fault_and_says_so_in_one_line() -> None:
    error = translate(rex.ActorDiedError())
    assert isinstance(error, ReplicaLostError) and is_replica_fault(error)
    assert error.message == "a stage process failed: ActorDiedError"


def test_an_upstream_stage_death_passed_down_the_chain_is_still_a_replica_fault() -> None:
    assert isinstance(translate(_task_error(rex.ActorDiedError())), ReplicaLostError)


def test_a_timeout_is_a_replica_fault() -> None:
    error = translate(StageTimeoutError("the batch ran past the watchdog's limit of 3 s"))
    assert is_replica_fault(error)


def test_the_watchdog_starts_generous_then_follows_ten_times_the_p99() -> None:
    watchdog = Watchdog(floor_s=0.5, start_s=60.0, min_samples=20, window=32)
    for _ in range(19):
        watchdog.observe(8, 0.2)
    assert watchdog.limit_s(8) == 60.0  # too few batches seen to judge
    watchdog.observe(8, 0.2)
    assert watchdog.limit_s(8) == 2.0
    for _ in range(64):
        watchdog.observe(8, 0.01)
    assert watchdog.limit_s(8) == 0.5  # the floor: never tighter


def test_the_watchdog_judges_each_batch_size_by_its_own_times() -> None:
    watchdog = Watchdog(floor_s=0.5, min_samples=20)
    for _ in range(20):
        watchdog.observe(8, 0.1)
        watchdog.observe(64, 0.8)
    # One limit for both would be set by one size and kill the other's batches (or let hangs
    # of the small ones run 8x too long).
    assert watchdog.limit_s(8) == pytest.approx(1.0)
    assert watchdog.limit_s(64) == pytest.approx(8.0)


def test_a_size_not_seen_yet_is_scaled_from_the_largest_size_seen() -> None:
    watchdog = Watchdog(floor_s=0.5, min_samples=20)
    for _ in range(20):
        watchdog.observe(8, 0.1)
        watchdog.observe(64, 0.8)
    for _ in range(5):
        watchdog.observe(256, 100.0)  # too few to judge 256 by its own times
    # A raised max_batch_size: 10 x p99 of 64 rows x 256 / 64, not the limit of 64 rows.
    assert watchdog.limit_s(256) == pytest.approx(32.0)
    assert watchdog.limit_s(32) == pytest.approx(4.0)
    assert watchdog.limit_s(1) == 0.5  # the floor


def test_a_fixed_limit_overrides_the_measured_one() -> None:
    watchdog = Watchdog(3.0)
    for _ in range(100):
        watchdog.observe(8, 10.0)
    assert watchdog.limit_s(8) == 3.0
    assert watchdog.limit_s(4096) == 3.0


def test_a_stage_that_raised_our_own_error_is_passed_through_as_is() -> None:
    raised = ModelError("InvalidArgumentError: indices[0,2] = 1000 is not in [0, 10)", True)
    assert translate(_task_error(raised)) is raised
