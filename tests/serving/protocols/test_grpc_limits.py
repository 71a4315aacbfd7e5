"""What a gRPC call may hold (issue 37, item 8): Health.Watch streams and calls that never send
their message have caps and timers of their own, so that they cannot take the slots of the
calls being served; a connection is closed once idle or old."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.protocols.grpc_limits import CallLimits
from serving.protocols.grpc_port import start_grpc_server, stop_grpc_server
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from serving.protocols.v2.proto import grpc_service_pb2_grpc as pb_grpc
from serving.server.state import ServerState
from serving.settings.config import ConfigError, Settings, load_settings
from tests.serverproc import free_ports

LIVE = "/inference.GRPCInferenceService/ServerLive"


@contextlib.asynccontextmanager
async def serve(**overrides: Any) -> AsyncIterator[tuple[grpc.aio.Channel, CallLimits]]:
    (port,) = free_ports(1)
    settings = Settings(model="fake", host="127.0.0.1", grpc_port=port, **overrides)
    limits = CallLimits(settings)
    server = await start_grpc_server(ServerState(settings), settings, limits=limits)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, limits
    finally:
        await stop_grpc_server(server, grace_s=0)


def silent_call(channel: grpc.aio.Channel, never: asyncio.Event) -> Any:
    """A ServerLive call that opens and then never sends its message (on the wire, a unary
    call whose client stalls after its headers)."""

    async def nothing() -> AsyncIterator[pb.ServerLiveRequest]:
        await never.wait()
        yield pb.ServerLiveRequest()

    call = channel.stream_unary(
        LIVE,
        request_serializer=pb.ServerLiveRequest.SerializeToString,
        response_deserializer=pb.ServerLiveResponse.FromString,
    )
    return call(nothing())


async def until(test: Any) -> None:
    async with asyncio.timeout(20):
        while not test():
            await asyncio.sleep(0.01)


async def first_answer(watch: Any) -> Any:
    try:
        return (await watch.read()).status
    except grpc.aio.AioRpcError as exc:
        return exc.code()


async def test_a_call_is_answered_while_300_watch_streams_and_300_silent_calls_are_open() -> None:
    """With the defaults. Before, grpc's one cap (256) counted both: with 300 Watch streams
    open, a health Check got RESOURCE_EXHAUSTED."""
    never = asyncio.Event()
    async with serve() as (channel, limits):
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(300)]
        silent = [silent_call(channel, never) for _ in range(300)]
        try:
            firsts = await asyncio.gather(*(first_answer(w) for w in watches))
            await until(lambda: limits.waiting == 300)
            live = await pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                pb.ServerLiveRequest(), timeout=10
            )
            check = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            held = (limits.streams, limits.waiting, limits.served)
        finally:
            for call in (*watches, *silent):
                call.cancel()
    assert live.live
    assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no model loaded
    refused = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (firsts.count(health_pb2.HealthCheckResponse.NOT_SERVING), firsts.count(refused)) == (
        256,
        44,
    )  # the streams' own cap (grpc_max_streams)
    assert held == (256, 300, 0)


async def test_a_message_that_does_not_come_in_time_ends_its_call() -> None:
    never = asyncio.Event()
    async with serve(body_read_timeout_s=0.3) as (channel, limits):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await silent_call(channel, never)
        waiting = limits.waiting
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.value.details() == (
        "the request message did not arrive within body_read_timeout_s=0.3 s; send it with the "
        "call, or raise body_read_timeout_s"
    )
    assert waiting == 0


async def test_silent_calls_take_no_served_slot_and_streams_have_their_own_cap() -> None:
    never = asyncio.Event()
    async with serve(grpc_max_concurrent_rpcs=1, grpc_max_streams=1) as (channel, limits):
        health = health_pb2_grpc.HealthStub(channel)
        silent = [silent_call(channel, never) for _ in range(3)]
        watch = health.Watch(health_pb2.HealthCheckRequest())
        try:
            await watch.read()
            await until(lambda: limits.waiting == 3)
            check = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            second = health.Watch(health_pb2.HealthCheckRequest())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await second.read()
        finally:
            for call in (watch, *silent):
                call.cancel()
    assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == (
        "too many gRPC streams open: 1 (Health.Watch, reflection), grpc_max_streams=1; close "
        "one, or retry later"
    )
    assert ("retry-after", "1") in tuple(info.value.trailing_metadata() or ())


async def test_an_old_connection_is_closed_streams_included() -> None:
    """grpc's connection age, with the grace of a request's deadline: a Watch stream that would
    live for ever ends, and the client reconnects."""
    async with serve(grpc_max_connection_age_s=0.3, request_timeout_ms=300) as (channel, _):
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest())
        await watch.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(20):
                while True:
                    await watch.read()
        again = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert again.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_an_idle_connection_is_closed() -> None:
    async with serve(grpc_max_connection_idle_s=0.3) as (channel, _):
        health = health_pb2_grpc.HealthStub(channel)
        await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert channel.get_state() == grpc.ChannelConnectivity.READY
        async with asyncio.timeout(20):
            await channel.wait_for_state_change(grpc.ChannelConnectivity.READY)
        after = channel.get_state()
    assert after == grpc.ChannelConnectivity.IDLE


def test_the_grpc_limit_settings() -> None:
    settings = load_settings()
    assert (
        settings.grpc_max_streams,
        settings.grpc_max_open_calls,
        settings.grpc_max_connection_idle_s,
        settings.grpc_max_connection_age_s,
    ) == (256, 1024, 300.0, 3600.0)
    with pytest.raises(ConfigError, match="grpc_max_open_calls"):
        load_settings(grpc_max_open_calls="100")  # under grpc_max_concurrent_rpcs (256)
