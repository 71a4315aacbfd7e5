"""The wait policies behind one interface: what each says about a queue head."""

from __future__ import annotations

from serving.batching.cost import RunTimeModel
from serving.batching.settings import BatchSettings
from serving.batching.wait import AutoWait, FixedWait, wait_policy


def _ask(policy: BatchSettings, runtime: RunTimeModel, **head: int | float) -> str | None:
    wait = wait_policy(policy, runtime)
    return wait.close_reason(
        policy,
        rows=int(head.get("rows", 1)),
        waited_s=float(head.get("waited_s", 0.0)),
        inflight_batches=int(head.get("inflight", 0)),
        outstanding_rows=int(head.get("outstanding", 1)),
    )


def test_the_settings_pick_the_policy() -> None:
    runtime = RunTimeModel()
    assert isinstance(wait_policy(BatchSettings(batch_timeout_ms=5), runtime), FixedWait)
    assert isinstance(wait_policy(BatchSettings(batch_timeout_ms="auto"), runtime), AutoWait)


def test_a_fixed_wait_closes_on_its_timeout_whatever_the_pipeline_does() -> None:
    policy, runtime = BatchSettings(batch_timeout_ms=5), RunTimeModel()
    assert _ask(policy, runtime, waited_s=0.004, inflight=0) is None
    assert _ask(policy, runtime, waited_s=0.005, inflight=3) == "timeout"
    wait = wait_policy(policy, runtime)
    assert wait.wait_s(policy, 1, 0) == wait.wait_s(policy, 1, 3) == 0.005
    assert wait.batch_limit(policy, 10.0, now=0.0, queued=40) == policy.max_batch_size


def test_auto_sends_at_once_to_an_idle_pipeline_and_waits_one_batch_time_when_busy() -> None:
    policy = BatchSettings(
        batch_timeout_ms="auto", max_batch_size=32, max_inflight_batches=3, pipeline_depth=2
    )
    runtime = RunTimeModel()
    runtime.observe(8, 0.040)
    assert _ask(policy, runtime, inflight=0) == "idle"
    # Busy: 2 batches compute at once, 20 rows out there -> a batch waits for 10 of them.
    assert _ask(policy, runtime, rows=9, inflight=2, outstanding=20, waited_s=0.01) is None
    assert _ask(policy, runtime, rows=10, inflight=2, outstanding=20) == "target"
    assert _ask(policy, runtime, rows=9, inflight=2, outstanding=20, waited_s=0.04) == "timeout"
    wait = wait_policy(policy, runtime)
    assert (wait.wait_s(policy, 9, 0), wait.wait_s(policy, 9, 2)) == (0.0, 0.040)


def test_auto_with_an_slo_shortens_the_wait_and_caps_the_batch() -> None:
    policy = BatchSettings(batch_timeout_ms="auto", max_batch_size=32, slo_p99_ms=50)
    runtime = RunTimeModel()
    runtime.observe(4, 0.030, now=100.0)
    runtime.observe(32, 0.080, now=100.0)
    wait = wait_policy(policy, runtime)
    # 4 rows predicted at 30 ms: at most 20 ms of the 50 ms budget is left for waiting.
    assert abs(wait.wait_s(policy, 4, 1) - 0.020) < 1e-9
    # 10 ms waited: 40 ms left, and a batch of 4 (30 ms) fits where 32 (80 ms) does not.
    assert wait.batch_limit(policy, 0.010, now=100.01, queued=20) == 4
