"""What the replica set notes on a traced batch's span (``shards.tracing.BATCH``): the replica
and its tries, a replica fault, and the watchdog's kill of a hung stage with its reason. Over the
fake replicas of ``test_replica_set_retry`` (pure asyncio, no Ray); the batch span that takes
these notes is checked in ``tests/serving/telemetry``."""

from __future__ import annotations

from shards.tracing import BATCH, BatchTrace
from tests.shards.pipeline.test_replica_set_retry import (
    BATCH as INPUTS,
)
from tests.shards.pipeline.test_replica_set_retry import (
    Script,
    assert_answered,
    hung,
    lost,
    make_group,
)

TRACEPARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


async def traced_run(script: Script) -> BatchTrace:
    """One batch over two fake replicas running ``script``, answered, on a traced span: its
    notes."""
    group, _ = make_group(script, replicas=2)
    noted = BatchTrace(TRACEPARENT)
    token = BATCH.set(noted)
    try:
        assert_answered(await group.run(INPUTS))
    finally:
        BATCH.reset(token)
        await group.close()
    return noted


async def test_a_hung_batch_notes_the_watchdog_kill_and_its_retry() -> None:
    noted = await traced_run(Script(hung()))
    names = [name for name, _ in noted.events]
    assert names == ["replica fault", "watchdog kill"]
    kill = noted.events[1][1]
    assert kill["reason"] == "the batch ran past the watchdog's limit of 5 s"
    assert kill["waited_behind"] is False
    assert noted.attributes["shardserve.replica_tries"] == 2  # answered by the other replica


async def test_a_lost_stage_is_a_fault_but_no_watchdog_kill() -> None:
    noted = await traced_run(Script(lost()))
    assert [name for name, _ in noted.events] == ["replica fault"]
