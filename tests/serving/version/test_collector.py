"""The front end's garbage collector once a version is READY: what the load left alive is frozen
in the server's own process, the first threshold is the setting's, and a later READY (a switch)
lets go of what a retired version left behind."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from serving.version.collector import freeze_heap
from tests.fakes import FakeRunner
from tests.serving.served_app import serve


@pytest.fixture(autouse=True)
def collector() -> Iterator[None]:
    """Each test starts with nothing frozen and leaves the test process's collector as it was."""
    threshold = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


async def test_the_heap_is_frozen_once_the_server_is_ready() -> None:
    assert gc.get_freeze_count() == 0
    async with serve(FakeRunner(), gc_first_threshold=20_000) as client:
        assert (await client.get("/readyz")).status_code == 200
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == 20_000


async def test_turned_off_nothing_is_frozen() -> None:
    threshold = gc.get_threshold()
    async with serve(FakeRunner(), gc_freeze=False) as client:
        assert (await client.get("/readyz")).status_code == 200
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == threshold


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_a_later_freeze_collects_what_an_earlier_one_kept() -> None:
    node = _Node()
    gone = weakref.ref(node)
    freeze_heap(10_000)  # the first READY: the node is alive, so it is frozen
    del node
    gc.collect()
    assert gone() is not None  # frozen: no collection sees it
    freeze_heap(10_000)  # the next READY (a switch)
    assert gone() is None
