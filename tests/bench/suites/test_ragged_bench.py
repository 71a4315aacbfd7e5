"""The ragged bench's pure parts: its rows, the waste read from /metrics, the exactness
comparison and the verdicts of its table (the servers it starts are the e2e tests' business)."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from bench.models.ragged import SINGLE, get_model, lengths, rows
from bench.suites.ragged.check import decode, max_abs_diff, positions, waste
from bench.suites.ragged.report import ratios, render
from bench.suites.ragged.run import RaggedPlan


def test_mixed_rows_are_seeded_and_within_the_lengths() -> None:
    drawn = lengths(500, 8, 128, seed=3)
    assert drawn == lengths(500, 8, 128, seed=3) != lengths(500, 8, 128, seed=4)
    assert min(drawn) == 8 and max(drawn) == 128  # both ends included
    bert = rows(get_model("bert"), [5, 9], seed=0)
    assert [len(r["token_ids"]) for r in bert if isinstance(r, dict)] == [5, 9]
    assert bert[0]["padding_mask"] == [1] * 5 and bert[0]["segment_ids"] == [0] * 5  # type: ignore[index]
    tokens = rows(get_model("demo-tokens"), [7], seed=0)[0]
    assert isinstance(tokens, list) and len(tokens) == 7 and 0 not in tokens  # 0 pads


def test_a_plan_refuses_lengths_the_wrong_way_round_and_unknown_models() -> None:
    with pytest.raises(ValueError, match=r"<= --max-length, got 64\.\.16"):
        RaggedPlan(min_length=64, max_length=16)
    with pytest.raises(ValueError, match="unknown ragged model 'gpt'"):
        RaggedPlan(models=("gpt",))


def test_the_waste_is_pad_over_real_positions_summed_over_labels() -> None:
    key = 'shardserve_padded_positions_total{{kind="{}",model="{}"}}'
    before = {key.format("real", "a"): 100.0, key.format("pad", "a"): 10.0}
    after = {
        key.format("real", "a"): 300.0,
        key.format("pad", "a"): 60.0,
        key.format("real", "b"): 100.0,
        key.format("pad", "b"): 0.0,
        "shardserve_batch_size_rows_count": 9.0,
    }
    counted = positions(after, before)
    assert counted == {"real": 300.0, "pad": 50.0}
    assert waste(counted) == pytest.approx(50 / 300)
    assert waste(positions(before, before)) is None  # nothing was length padded


def test_answers_are_compared_by_output_and_a_shape_that_differs_is_named() -> None:
    one = decode(orjson.dumps({"predictions": [[0.5, 1.0]]}))
    assert list(one) == [SINGLE] and one[SINGLE].tolist() == [0.5, 1.0]
    many = decode(orjson.dumps({"predictions": [{"seq": [[1.0], [2.0]], "pooled": [3.0]}]}))
    want = {"seq": np.array([[1.0], [2.0]]), "pooled": np.array([3.00002])}
    diff, problems = max_abs_diff([many], [want])
    assert diff == pytest.approx(2e-5) and problems == []
    uncut = {"seq": np.zeros((4, 1)), "pooled": np.array([3.0])}  # not cut back to the row
    diff, problems = max_abs_diff([uncut], [want])
    assert diff is None and problems == ["row 0: seq has shape (4, 1), the row alone (2, 1)"]


def _run(variant: str, load: str, rps: float, real: float = 0.0, pad: float = 0.0) -> Any:
    return {
        "variant": variant,
        "load": load,
        "repeat": 0,
        "rps": rps,
        "p50_ms": 10.0,
        "p99_ms": 30.0,
        "mean_batch_rows": 8.0,
        "errors": 0,
        "positions": {"real": real, "pad": pad},
    }


def _results(mixed_rps: float) -> dict[str, Any]:
    plan = {
        "clients": 32,
        "min_length": 8,
        "max_length": 128,
        "seed": 0,
        "max_batch_size": 32,
        "seconds": 12.0,
        "warmup_s": 3.0,
        "repeats": 1,
        "pin": True,
        "stages": 2,
        "batch_timeout_ms": 5.0,
    }
    runs = [
        _run("padded", "uniform", 100.0),
        _run("padded", "mixed", mixed_rps, real=1000, pad=400),
        _run("auto", "mixed", mixed_rps, real=1000, pad=250),
        _run("unpadded", "mixed", 40.0),
    ]
    exact = {"rows": 32, "batches": 3.0, "batched_vs_model": 3e-6, "problems": []}
    model = {
        "about": "tokens",
        "tolerance": 1e-5,
        "runs": runs,
        "exactness": {
            "padded": {**exact, "alone_vs_model": 2e-6, "batched_vs_alone": 2e-5},
            "unpadded": {**exact, "batched_vs_model": 0.0},
        },
    }
    checked = {
        "flags": ["--pad-input=tokens=0"],
        "parameters": {"length_padding": {"off": "padding changes this model's answers"}},
        "log_lines": ["length padding off: padding changes this model's answers at length 7"],
        "positions": {"real": 0.0, "pad": 0.0},
        "exactness": {**exact, "batched_vs_model": 1e-7},
    }
    padded = {**checked, "positions": {"real": 300.0, "pad": 100.0}, "log_lines": []}
    unsafe = {
        "name": "demo-conv1d",
        "about": "conv",
        "tolerance": 1e-5,
        "servers": {"pad-input": checked, "wrongly": padded},
    }
    return {"plan": plan, "models": {"demo-tokens": model}, "unsafe": unsafe}


def test_the_table_judges_both_ratios_the_waste_and_the_exactness() -> None:
    good = _results(mixed_rps=90.0)
    assert ratios(good["models"]["demo-tokens"]["runs"]) == {
        "mixed_over_uniform": pytest.approx(0.9),
        "padded_over_unpadded": pytest.approx(2.25),
    }
    table = render(good)
    assert "req/s mixed / uniform: 0.90x (target >= 0.8x): met" in table
    assert "length padded / --no-pad-lengths: 2.25x (target >= 2x): met" in table
    assert "0.40 at 5 ms, 0.25 with the cost model" in table
    assert "through the server 2.00e-05 (NOT within 1e-05)" in table
    assert "exactly the behaviour before issue 19" in table
    assert "served pad-input (`--pad-input=tokens=0`)" in table
    assert "answers at length 7" in table and "- unpadded: 32 rows sent together" in table
    assert "- LENGTH PADDED: 32 rows" in table  # the server that padded it anyway
    slow = render(_results(mixed_rps=70.0))
    assert "0.70x (target >= 0.8x): NOT met" in slow and "1.75x (target >= 2x): NOT met" in slow
