"""A request's priority level on every generate route, in process over the fake replica (issue
41): the body's field, V2's ``parameters.priority`` and the ``X-Priority`` header; a level not
known is a 400 naming the known ones; the level labels the request's TTFT."""

from __future__ import annotations

import pytest

from serving.generation.engine import scheduler_settings
from serving.generation.levels import Levels
from serving.settings.config import Settings
from tests.generation_fakes import FakeGenerationReplica
from tests.metrics_text import metric
from tests.serving.protocols.v2.test_v2_generate import serve

V2 = "/v2/models/fake/generate"
LABELS = {"model": "fake", "version": "1"}


async def test_the_field_then_the_header_choose_the_level() -> None:
    async with serve(FakeGenerationReplica()) as client:
        asked = [
            ({"input_ids": [1], "parameters": {"max_tokens": 2, "priority": "high"}}, {}),
            ({"input_ids": [1], "parameters": {"max_tokens": 2}}, {"X-Priority": "high"}),
            ({"input_ids": [1], "parameters": {"max_tokens": 2}}, {}),
            (
                {"input_ids": [1], "parameters": {"max_tokens": 2, "priority": "low"}},
                {"X-Priority": "high"},
            ),
        ]
        for body, headers in asked:
            answer = await client.post(V2, json=body, headers=headers)
            assert answer.status_code == 200, answer.text
        text = (await client.get("/metrics")).text
        name = "shardserve_time_to_first_token_seconds_count"
        assert metric(text, name, **LABELS, priority="high") == 2
        assert metric(text, name, **LABELS, priority="low") == 3  # the warm-up's too
        waits = "shardserve_generation_queue_wait_seconds_count"
        assert metric(text, waits, **LABELS, priority="high") == 2


@pytest.mark.parametrize(
    ("url", "body", "headers", "message"),
    [
        (V2, {"input_ids": [1], "parameters": {"priority": "top"}}, {}, "parameters.priority is"),
        (V2, {"input_ids": [1]}, {"X-Priority": "top"}, "header X-Priority is 'top'"),
    ],
)
async def test_an_unknown_level_is_a_400_naming_the_known_ones(
    url: str, body: object, headers: dict[str, str], message: str
) -> None:
    async with serve(FakeGenerationReplica()) as client:
        answer = await client.post(url, json=body, headers=headers)
        assert answer.status_code == 400, answer.text
        assert message in answer.text and "high, low" in answer.text


async def test_configured_levels_are_the_ones_known() -> None:
    settings = Settings(model="fake", priority_levels="gold,silver", default_priority="silver")
    chosen = scheduler_settings(settings)
    assert chosen.levels == Levels(("gold", "silver"), "silver")
    async with serve(FakeGenerationReplica(), scheduler=chosen) as client:
        body = {"input_ids": [1], "parameters": {"max_tokens": 1, "priority": "gold"}}
        answer = await client.post(V2, json=body)
        assert answer.status_code == 200, answer.text
        refused = await client.post(V2, json={"input_ids": [1]}, headers={"X-Priority": "high"})
        assert refused.status_code == 400 and "gold, silver" in refused.text
