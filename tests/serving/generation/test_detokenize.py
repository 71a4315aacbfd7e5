"""Text out of ids as they come: stop strings held back until decided, cut exactly."""

from __future__ import annotations

import pytest

from serving.generation.detokenize import StopCut


@pytest.mark.parametrize(
    ("pieces", "stops", "out", "stopped"),
    [
        (["ab", "c", "d"], ["cd"], ["ab", "", ""], True),  # "c" held until "d" decides it
        (["ab", "c", "e"], ["cd"], ["ab", "", "ce"], False),  # "c" let go once "e" follows
        (["x<", "/s", ">y"], ["</s>"], ["x", "", ""], True),  # spans three pieces
        (["hello"], ["zz", "ll"], ["he"], True),  # cut before the first stop string met
        (["a", "b"], [], ["a", "b"], False),
    ],
)
def test_a_stop_string_is_held_back_then_cut(
    pieces: list[str], stops: list[str], out: list[str], stopped: bool
) -> None:
    cut = StopCut(stops)
    assert [cut.push(p) for p in pieces] == out
    assert cut.stopped is stopped


def test_what_is_held_comes_out_at_the_end() -> None:
    cut = StopCut(["abc"])
    assert cut.push("xab") == "x"
    assert cut.flush() == "ab"
