"""Errors leave ``shards`` as one clean line: no colours, pids, IPs, actor ids or reprs."""

from __future__ import annotations

import pickle

import pytest

from shards.errors import (
    BundleError,
    ModelError,
    PipelineStartError,
    PlanError,
    ShardsError,
    StartError,
    one_line,
)


class InvalidArgumentError(Exception):
    """Named like TensorFlow's, which is what ``one_line`` keys on."""


RAY_TEXT = (
    "\x1b[36mray::ShardActor.forward()\x1b[39m (pid=4242, ip=10.0.3.7, actor_id=8f3e2a, "
    "repr=<shards.actor.ShardActor object at 0x7f3a2b>) stage exploded at 10.0.3.7:6379"
)
TF_TEXT = (
    "Graph execution error:\n\nDetected at node embed/GatherV2 defined at (most recent call "
    'last):\n  File "/x/actor.py", line 88, in forward\n\nindices[0,2] = 1000 is not in '
    "[0, 10)\n\t [[{{node embed/GatherV2}}]] [Op:__inference_step_311]"
)


def test_a_remote_error_is_scrubbed_to_one_line() -> None:
    assert one_line(RuntimeError(RAY_TEXT)) == (
        "RuntimeError: ray::ShardActor.forward() stage exploded at"
    )


def test_a_tensorflow_graph_error_keeps_the_ops_own_reason() -> None:
    assert one_line(InvalidArgumentError(TF_TEXT)) == (
        "InvalidArgumentError: indices[0,2] = 1000 is not in [0, 10)"
    )


def test_a_long_message_is_cut() -> None:
    assert len(one_line(ValueError("x" * 1000))) == 300


@pytest.mark.parametrize(
    "error",
    [ModelError("InvalidArgumentError: bad id", input_blamed=True), PlanError("too many stages")],
)
def test_errors_cross_a_process_boundary_whole(error: ShardsError) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and back.message == error.message
    assert getattr(back, "input_blamed", None) == getattr(error, "input_blamed", None)


def test_the_tree_keeps_the_builtin_bases_callers_caught_before() -> None:
    assert issubclass(PlanError, ValueError) and issubclass(BundleError, ValueError)
    assert issubclass(PipelineStartError, StartError) and issubclass(StartError, RuntimeError)
    assert all(issubclass(e, ShardsError) for e in (PlanError, BundleError, PipelineStartError))
