"""The open-loop timeline load: its schedule, the version read from an answer, and one short
drive against a small local server (the versions it answers and a refused request kept)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from bench.load.timeline import Action, Step, answered_version, drive, due_times, step_bounds


def test_requests_are_evenly_spaced_inside_each_step_and_steps_follow_each_other() -> None:
    steps = [Step(2.0, 1.0), Step(4.0, 0.5), Step(0.0, 1.0), Step(1.0, 2.0)]
    assert due_times(steps) == [0.0, 0.5, 1.0, 1.25, 2.5, 3.5]
    assert step_bounds(steps) == [(0.0, 1.0), (1.0, 1.5), (1.5, 2.5), (2.5, 4.5)]
    with pytest.raises(ValueError, match="seconds > 0"):
        Step(1.0, 0.0)


def test_the_answering_version_is_read_from_a_v2_answer_only() -> None:
    assert answered_version(200, b'{"model_name": "m", "model_version": "3", "outputs": []}') == "3"
    assert answered_version(200, b"{}") == ""
    assert answered_version(200, b"not json") == ""
    assert answered_version(422, b'{"model_version": "3"}') == ""


def test_a_drive_keeps_every_reply_with_its_status_version_and_when_an_action_ran() -> None:
    async def main() -> tuple[list[tuple[int, str, str]], dict[str, float]]:
        served = {"version": "1"}

        async def infer(request: web.Request) -> web.Response:
            body = await request.read()
            if body == b"bad":
                return web.json_response({"error": "the model failed"}, status=422)
            return web.json_response({"model_version": served["version"], "outputs": []})

        app = web.Application()
        app.router.add_post("/infer", infer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        switch = Action(0.25, "switch", lambda: served.update(version="2"))
        try:
            timeline = await drive(
                f"http://127.0.0.1:{port}/infer",
                [b"ok", b"ok", b"ok", b"bad"],
                [Step(20.0, 0.5)],
                start=time.perf_counter(),
                actions=[switch],
            )
        finally:
            await runner.cleanup()
        replies = [(r.status, r.version, r.detail[:3]) for r in timeline.replies]
        return replies, timeline.actions

    replies, actions = asyncio.run(main())
    assert len(replies) == 10
    assert [s for s, _, _ in replies].count(422) == 2
    assert all(d == "422" for s, _, d in replies if s == 422)
    versions = [v for s, v, _ in replies if s == 200]
    assert versions[0] == "1" and versions[-1] == "2"
    assert versions == sorted(versions)  # once switched, never back
    assert 0.25 <= actions["switch"] < 0.5


def test_no_request_starts_once_until_says_so_and_a_refused_connection_is_kept() -> None:
    calls = iter(range(100))
    timeline = asyncio.run(
        drive(
            "http://127.0.0.1:1/infer",  # nothing listens on port 1
            [b"{}"],
            [Step(100.0, 1.0)],
            start=time.perf_counter(),
            until=lambda: next(calls) >= 3,
        )
    )
    assert [r.index for r in timeline.replies] == [0, 1, 2]
    assert all(r.status == 0 and r.detail.startswith("no answer") for r in timeline.replies)
