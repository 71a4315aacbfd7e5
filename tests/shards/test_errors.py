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
    "repr=<shards.actor.stage_actor.ShardActor object at 0x7f3a2b>) stage exploded at 10.0.3.7:6379"
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


@pytest.mark.parametrize(
    ("text", "leak"),
    [
        ("stage lost: connection to 2001:db8::7 reset", "2001:db8::7"),
        ("raylet at [fe80::1%eth0]:6379 did not answer", "fe80::1"),
        ("the node 2001:0db8:85a3:0000:0000:8a2e:0370:7334 died", "8a2e"),
        ("actor on ip-10-0-0-12.ec2.internal died", "ip-10-0-0-12"),
        ("actor on ip-10-0-0-12 died", "ip-10-0-0-12"),
        ("GCS at node-3.cluster.local:6379 unreachable", "cluster.local"),
        ("cannot read '/home/alice/models/bundle/manifest.json' as JSON", "/home/alice"),
        (r"cannot read 'C:\Users\alice\m.keras'", "alice"),
        ("stage was <shards.actor.stage_actor.ShardActor object at 0x7f3a2b10>", "0x7f3a2b10"),
    ],
)
def test_one_line_drops_addresses_host_names_paths_and_reprs(text: str, leak: str) -> None:
    line = one_line(RuntimeError(text))

    assert leak not in line
    assert line.startswith("RuntimeError: ")


def test_a_path_keeps_its_last_part_and_the_rest_of_the_message_is_kept() -> None:
    error = BundleError("bundle directory '/srv/models/resnet-bundle' does not exist")

    assert one_line(error) == "BundleError: bundle directory 'resnet-bundle' does not exist"


@pytest.mark.parametrize(
    "text",
    [
        "indices[0,2] = 1000 is not in [0, 10)",
        "retry when GET /readyz answers 200",
        "op model/dense_1/MatMul: shapes 3/4 at 12:30:45 with saved_model.pb, keras 3.10.0",
        "ray::ShardActor.forward() failed",
        "cannot pickle 'threading.local' object",
    ],
)
def test_the_scrubber_leaves_ordinary_text_alone(text: str) -> None:
    assert one_line(ValueError(text)) == f"ValueError: {text}"
