"""The generation bench's pure parts: its seeded requests and arrivals, the peer's padded batch
(and that keras_hub's generate over it answers each row as generate() alone), the percentiles
read from the server's histograms, the capacity and the table (the servers it starts are the
e2e tests' business; nothing here is timed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from bench.load.pyload import arrivals
from bench.models.generation import VOCABULARY_SIZE
from bench.suites.generate.report import (
    TTFT,
    capacity,
    histogram_quantile,
    kept_up,
    percentile,
    queueing,
    render,
    summarize,
)
from bench.suites.generate.run import GeneratePlan
from bench.systems.keras_generate import answers, pad_batch
from tests.bench.suiterun import SuiteRun
from tests.generation_models import TOTAL_LENGTH, Greedy


def test_the_requests_are_seeded_within_their_ranges_with_stop_ids_off() -> None:
    plan = GeneratePlan(min_prompt=16, max_prompt=64, min_tokens=8, max_tokens=128)
    bodies = plan.requests(400, seed=5)
    assert bodies == plan.requests(400, seed=5) != plan.requests(400, seed=6)
    decoded = [orjson.loads(b) for b in bodies]
    lengths = [len(d["input_ids"]) for d in decoded]
    tokens = [d["parameters"]["max_tokens"] for d in decoded]
    assert (min(lengths), max(lengths)) == (16, 64)  # both ends drawn
    assert (min(tokens), max(tokens)) == (8, 128)
    assert all(0 < i < VOCABULARY_SIZE for d in decoded for i in d["input_ids"])
    assert all(d["parameters"]["stop_token_ids"] == [] for d in decoded)
    assert plan.shape.max_length == 64 + 128  # the longest prompt and answer fit a slot


def test_the_arrivals_are_poisson_of_the_rate_and_repeatable() -> None:
    due = arrivals(4.0, 500.0, True, seed=3)
    assert np.array_equal(due, arrivals(4.0, 500.0, True, seed=3))
    assert due[0] == 0 and due[-1] < 500 and np.all(np.diff(due) >= 0)
    gaps = np.diff(due)
    assert len(due) == pytest.approx(2000, rel=0.1)
    assert np.std(gaps) == pytest.approx(np.mean(gaps), rel=0.1)  # exponential: sd = mean


def test_a_plan_refuses_no_rates_unknown_systems_and_ranges_the_wrong_way_round() -> None:
    with pytest.raises(ValueError, match="rates must be > 0"):
        GeneratePlan(rates=(1.0, 0.0))
    with pytest.raises(ValueError, match="unknown system 'vllm'"):
        GeneratePlan(systems=("shardserve", "vllm"))
    with pytest.raises(ValueError, match=r"got 64\.\.16"):
        GeneratePlan(min_prompt=64, max_prompt=16)
    with pytest.raises(ValueError, match=r"stages \(2\) must be at most blocks \(1\)"):
        GeneratePlan(blocks=1, stages=2)


def test_a_padded_batch_marks_exactly_the_positions_each_row_generates() -> None:
    ids, mask = pad_batch([([5, 6, 7], 2), ([9], 4)], batch=4, length=8)
    assert ids.shape == mask.shape == (4, 8)
    assert ids[0].tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert (~mask[0]).nonzero()[0].tolist() == [3, 4]
    assert (~mask[1]).nonzero()[0].tolist() == [1, 2, 3, 4]
    assert ids[2].tolist() == ids[3].tolist() == ids[0].tolist()  # missing rows copy row 0
    out = np.arange(32).reshape(4, 8)
    assert answers(out, [([5, 6, 7], 2), ([9], 4)]) == [[3, 4], [9, 10, 11, 12]]
    with pytest.raises(ValueError, match="row 1: a prompt of 7 ids and 2 new tokens"):
        pad_batch([([1], 1), ([1] * 7, 2)], batch=2, length=8)
    with pytest.raises(ValueError, match="1 to 2 rows, got 3"):
        pad_batch([([1], 1)] * 3, batch=2, length=8)


def test_the_peer_answers_each_row_as_keras_hub_generates_it_alone(gpt2_greedy: Greedy) -> None:
    from bench.systems.keras_generate import StaticGenerator

    generator = StaticGenerator(str(gpt2_greedy.preset), batch=8, length=TOTAL_LENGTH)
    # Rows of different lengths and budgets: each stops at its own max_tokens, and a batch whose
    # rows all end early stops early and still answers every row.
    rows = [(p, TOTAL_LENGTH - len(p) - i) for i, p in enumerate(gpt2_greedy.prompts)]
    got = generator.generate(rows)
    assert got == [list(g[:m]) for (_, m), g in zip(rows, gpt2_greedy.generated, strict=True)]
    short = [(gpt2_greedy.prompts[1], 3), (gpt2_greedy.prompts[2], 1)]
    assert generator.generate(short) == [
        list(gpt2_greedy.generated[1][:3]),
        list(gpt2_greedy.generated[2][:1]),
    ]


def _hist(counts: dict[str, float]) -> dict[str, float]:
    return {f'{TTFT}_bucket{{le="{le}"}}': n for le, n in counts.items()}


def test_quantiles_come_from_what_the_histogram_gained_between_scrapes() -> None:
    before = _hist({"0.1": 5, "0.5": 5, "1.0": 5, "+Inf": 5})
    after = _hist({"0.1": 5, "0.5": 55, "1.0": 105, "+Inf": 105})  # 100 new: 50 in 0.1..0.5
    assert histogram_quantile(after, before, TTFT, 0.5) == pytest.approx(0.5)
    assert histogram_quantile(after, before, TTFT, 0.25) == pytest.approx(0.3)
    assert histogram_quantile(after, before, TTFT, 0.95) == pytest.approx(0.95)
    beyond = _hist({"0.1": 5, "0.5": 5, "1.0": 15, "+Inf": 105})  # most past the last bound
    assert histogram_quantile(beyond, before, TTFT, 0.95) == 1.0
    assert histogram_quantile(before, before, TTFT, 0.5) is None  # nothing observed


def test_quantiles_sum_a_histograms_series_over_its_other_labels() -> None:
    # The TTFT histogram has a series per priority level (issue 41): a quantile is over them all.
    def by_level(level: str, counts: dict[str, float]) -> dict[str, float]:
        return {f'{TTFT}_bucket{{le="{le}",priority="{level}"}}': n for le, n in counts.items()}

    after = {
        **by_level("high", {"0.1": 50, "0.5": 50, "1.0": 50, "+Inf": 50}),
        **by_level("low", {"0.1": 0, "0.5": 0, "1.0": 50, "+Inf": 50}),
    }
    assert histogram_quantile(after, {}, TTFT, 0.25) == pytest.approx(0.05)
    assert histogram_quantile(after, {}, TTFT, 0.75) == pytest.approx(0.75)


def test_percentiles_of_the_clients_latencies() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([], 50) is None


def test_the_capacity_is_the_highest_rate_within_the_ttft_bound_with_nothing_failed() -> None:
    by_rate = {
        0.5: {"ttft_p95_s": 0.4, "errors": 0},
        1.0: {"ttft_p95_s": 1.9, "errors": 0},
        2.0: {"ttft_p95_s": 1.5, "errors": 3},  # within the bound but refusing
        4.0: {"ttft_p95_s": 9.0, "errors": 0},
    }
    assert capacity(by_rate, 2.0) == 1.0
    assert capacity(by_rate, 0.3) is None


def test_a_rate_is_kept_up_until_the_p95_latency_triples_over_the_lowest_rates() -> None:
    by_rate = {
        0.5: {"latency_p95_s": 6.0, "errors": 0},  # slow even alone: its own scale
        1.0: {"latency_p95_s": 17.0, "errors": 0},
        2.0: {"latency_p95_s": 19.0, "errors": 0},  # queueing
        4.0: {"latency_p95_s": 5.0, "errors": 1},  # failed requests do not count
    }
    assert kept_up(by_rate) == 1.0
    assert queueing(19.0, 6.0) and not queueing(17.0, 6.0) and not queueing(None, 6.0)
    assert kept_up({}) is None


def _record(system: str, rate: float, round_: int, tokens: float, p95: float) -> dict[str, Any]:
    return {
        "system": system,
        "rate": rate,
        "round": round_,
        "tokens_per_s": tokens,
        "offered_tokens_per_s": 100.0 * rate,
        "ttft_p50_s": p95 / 2,
        "ttft_p95_s": p95,
        "tpot_p50_s": 0.02,
        "tpot_p95_s": 0.05,
        "latency_p50_s": 1.0,
        "latency_p95_s": 2.0 if system == "shardserve" or rate < 2 else 7.0,
        "rows_per_step": None if system == "litserve" else 6.0,
        "errors": 0,
        "cpu": {"shard_actors": 1.5, "frontend": 0.2},
    }


def _results() -> dict[str, Any]:
    plan = {
        **{k: v for k, v in vars(GeneratePlan()).items() if not isinstance(v, Path)},
        "systems": ["shardserve", "litserve"],
        "rounds": 3,
    }
    runs = []
    for r, (fast, slow) in enumerate([(100.0, 50.0), (120.0, 40.0), (110.0, 45.0)]):
        runs += [
            _record("shardserve", 1.0, r, fast, 0.5),
            _record("shardserve", 2.0, r, 2 * fast, 1.0 + r),  # median p95 2.0: within
            _record("litserve", 1.0, r, slow, 1.5),
            _record("litserve", 2.0, r, 2 * slow, 3.0),
        ]
    ceiling = {"batch": 8, "batches": 12, "tokens_per_s": 440.0, "batch_s_p50": 1.2}
    return {"plan": plan, "model": "GPT-2 tiny", "runs": runs, "ceiling": ceiling}


def test_the_summary_takes_medians_over_rounds_and_ratios_against_the_peer_and_ceiling() -> None:
    summary = summarize(_results())
    main, peer = summary["systems"]["shardserve"], summary["systems"]["litserve"]
    assert main["by_rate"][2.0]["tokens_per_s"] == 220.0  # median of 200, 240, 220
    assert main["by_rate"][2.0]["ttft_p95_s"] == 2.0
    assert (main["capacity_rps"], peer["capacity_rps"]) == (2.0, 1.0)
    assert summary["ratios"]["capacity_vs_litserve"] == 2.0
    assert (main["kept_up_rps"], peer["kept_up_rps"]) == (2.0, 1.0)
    assert summary["ratios"]["best_tokens_vs_litserve"] == pytest.approx(220 / 90)
    assert summary["ratios"]["shardserve_best_tokens_vs_ceiling"] == pytest.approx(0.5)
    assert "best_tokens_vs_one_group" not in summary["ratios"]  # that system was not run
    assert summary["at_rate"][2.0]["ttft_p95_litserve_over_shardserve"] == pytest.approx(1.5)


def test_the_table_shows_each_rate_the_capacities_and_what_ttft_means_for_each() -> None:
    table = render(_results())
    assert (
        "| shardserve | 2 | 220.0 (200.0) | 1000 / 2000 | 20 / 50 | 1000 / 2000 | 6.0 | 0 |"
        in table
    )
    assert "| litserve | 1 | 45.0 (100.0) | 750 / 1500 | 20 / 50 | 1000 / 2000 | — | 0 |" in table
    assert (
        "- shardserve: 2 req/s (220.0 tokens/s there; best 220.0 tokens/s; highest rate " in table
    )
    assert "kept up (p95 latency <= 3 x its own at the lowest rate): 2 req/s)" in table
    assert "- litserve: 1 req/s" in table and "lowest rate): 1 req/s)" in table
    assert "capacity, shardserve / LitServe: 2.00" in table
    assert "440.0 useful tokens/s" in table
    assert "its TTFT is its full latency" in table
    assert "- at 2 req/s, LitServe / shardserve: p95 TTFT 1.5x, median latency 1.00x" in table
    assert "shard_actors 1.50" in table


def test_the_command_line_fills_the_plan_and_keeps_its_defaults() -> None:
    import argparse

    from bench.options import plan_from
    from bench.suites import generate

    parser = argparse.ArgumentParser()
    generate.add_parsers(parser.add_subparsers(dest="command"))
    argv = ["generate", "--blocks", "2", "--hidden", "64", "--rates", "1,4"]
    args = parser.parse_args([*argv, "--duration", "5", "--rounds", "1", "--systems", "litserve"])
    plan = plan_from(GeneratePlan, args)
    assert (plan.blocks, plan.hidden, plan.rates, plan.duration_s, plan.rounds) == (
        2,
        64,
        (1.0, 4.0),
        5.0,
        1,
    )
    assert plan.systems == ("litserve",) and plan.batch == GeneratePlan().batch


def test_generate_answers_every_request_its_max_tokens_on_each_system(
    bench_on_session_ray: SuiteRun,
) -> None:
    # Seconds of load kept short (what is asserted is that each system answers, not how fast):
    # at 4 req/s for 1 s the first arrival is due at once, so each system is sent a request.
    args = ["--blocks", "2", "--hidden", "32", "--rates", "4", "--duration", "1", "--rounds", "1"]
    args += ["--warmup", "0.3", "--ceiling-seconds", "0.3", "--max-prompt", "24"]
    args += ["--max-tokens", "16"]
    args += ["--paths", "systems"]  # the streamed path: test_generate_streamed_bench.py
    results = bench_on_session_ray.run("generate", *args)
    runs = {r["system"]: r for r in results["runs"]}
    assert sorted(runs) == sorted(GeneratePlan().systems)
    for run in runs.values():
        assert run["sent"] > 0 and run["errors"] == 0, run
        assert run["tokens"] == run["asked_tokens"]  # stop ids off: each answer is max_tokens long
    assert runs["shardserve"]["rows_per_step"] >= 1 and runs["litserve"]["rows_per_step"] is None
    assert results["ceiling"]["tokens_per_s"] > 0
    assert "| shardserve-1group | 4 |" in bench_on_session_ray.table("generate")
