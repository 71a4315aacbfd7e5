"""What each stage actor asks on one machine, and the private Ray's logical CPUs: the whole
TensorFlow threads of its share of the real cores, and a count that holds every model at once
plus one more (issue 20: a second model used to wait for CPUs the first one took)."""

from __future__ import annotations

import pytest

from shards.cpu_plan import (
    cpus_per_stage,
    intra_op_threads,
    pipeline_cpus,
    scheduling_cpus,
    stage_copies,
)


@pytest.mark.parametrize(
    ("requested", "private", "actors", "cores", "expected"),
    [
        (None, True, 4, 2, 1.0),  # 4 stages on 2 cores: one thread each, one CPU each
        (None, True, 3, 2, 1.0),  # never a fraction: Ray's grant is the actor's thread count
        (None, True, 2, 8, 4.0),  # spare cores become threads
        (None, True, 3, 8, 2.0),  # whole cores: 3 x 2 threads, not 3 x 2.67
        (None, False, 4, 2, 1.0),  # a cluster's CPUs are real: one each
        (2.0, True, 4, 2, 2.0),  # what the user asked for is kept
    ],
)
def test_a_stage_asks_for_the_whole_threads_of_its_share_of_the_cores(
    requested: float | None, private: bool, actors: int, cores: int, expected: float
) -> None:
    ask = cpus_per_stage(requested, private_ray=private, actors=actors, cores=cores)
    assert ask == expected
    assert intra_op_threads(ask) == max(1, int(ask))  # what the actor then runs
    if requested is None and private and actors <= cores:
        assert ask * actors <= cores  # a model alone never runs more threads than cores


def test_the_private_ray_holds_every_model_at_once_and_one_more() -> None:
    # On 2 cores: a 2-stage model asks 2 x 1, a 4-stage model with 2 replicas 8 x 1.
    two, eight = (2, 1, None), (4, 2, None)
    assert (pipeline_cpus(two, 2), pipeline_cpus(eight, 2)) == (2.0, 8.0)

    # Both at once, plus room for one more as large as the largest.
    assert scheduling_cpus([two, eight], cores=2) == 2 + 8 + 8
    # One small model: room for another the size of the machine.
    assert scheduling_cpus([(1, 1, None)], cores=16) == 16 + 16
    assert scheduling_cpus([], cores=4) == 4
    # A user's cpus_per_shard is what the stages ask.
    assert scheduling_cpus([(2, 1, 3.0)], cores=2) == 6 + 6


@pytest.mark.parametrize(("cpus", "threads"), [(0.25, 1), (0.5, 1), (1.0, 1), (1.5, 1), (4.0, 4)])
def test_intra_op_threads_are_whole_cores_at_least_one(cpus: float, threads: int) -> None:
    assert intra_op_threads(cpus) == threads


GiB = 2**30


def test_a_small_single_stage_becomes_one_single_threaded_replica_per_core() -> None:
    assert stage_copies(1, GiB, cores=2, available_bytes=16 * GiB) == 2
    assert stage_copies(1, GiB, cores=8, available_bytes=16 * GiB) == 8


def test_copies_only_where_every_copy_fits_in_half_the_free_memory() -> None:
    assert stage_copies(1, 4 * GiB, cores=2, available_bytes=16 * GiB) == 2  # 8 of 16 GiB
    assert stage_copies(1, 5 * GiB, cores=2, available_bytes=16 * GiB) == 1
    assert stage_copies(1, GiB, cores=16, available_bytes=16 * GiB) == 1


def test_several_stages_one_core_or_no_plan_keep_one_actor() -> None:
    assert stage_copies(2, GiB, cores=2, available_bytes=16 * GiB) == 1
    assert stage_copies(1, GiB, cores=1, available_bytes=16 * GiB) == 1
    assert stage_copies(1, 0, cores=2, available_bytes=16 * GiB) == 1
