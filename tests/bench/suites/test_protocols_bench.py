"""``python -m bench protocols`` on a tiny setting (light model, 1 s per protocol), so that it
cannot rot; its answer decoding and its target verdicts on canned figures."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from bench.load.loops import WRK_INSTALL_HINT, have_wrk
from bench.suites.protocols.check import decode_answer
from bench.suites.protocols.report import medians, render, targets
from loadtest.bodies import encode_body
from tests.bench.suiterun import SuiteRun
from tests.serverproc import free_ports


def _run(workload: str, protocol: str, rps: float, cpu_ms: float, repeat: int = 0) -> dict:
    return {
        "workload": workload,
        "protocol": protocol,
        "repeat": repeat,
        "concurrency": 256 if workload == "heavy" else 64,
        "rps": rps,
        "p50_ms": 100.0,
        "p99_ms": 200.0,
        "errors": 0,
        "cpu_ms_per_request": cpu_ms,
        "frontend_cores": 0.5,
        "loadgen_cores": 0.2,
        "mean_batch_rows": 40.0,
        "frontend_ms_per_request": cpu_ms,
        "workers_ms_per_row": 0.8,
        "ray_ms_per_request": 0.05,
        "idle_share": 0.13,
    }


def _results() -> dict:
    return {
        "plan": {"seconds": 10.0},
        "ceiling": {
            "heavy": {
                "batch_size": 64,
                "before_rows_per_s": 1900.0,
                "after_rows_per_s": 2100.0,
                "rows_per_s": 2000.0,
                "cpu_ms_per_row": 0.71,
            }
        },
        "runs": [
            _run("heavy", "tfserving", 800.0, 0.9),
            _run("heavy", "v2-binary", 1400.0, 0.2),
            _run("heavy", "v2-binary", 1600.0, 0.5, repeat=1),
            _run("light", "tfserving", 2000.0, 0.5),
            _run("light", "v2-binary", 2400.0, 0.3),
        ],
    }


def test_targets_are_judged_on_medians_over_rounds() -> None:
    results = _results()
    med = medians(results["runs"])
    assert med[("heavy", "v2-binary")]["rps"] == 1500.0
    assert med[("heavy", "v2-binary")]["n"] == 2
    checks = targets(results, med)
    assert [ok for _, _, ok in checks] == [True, False, False]
    assert checks[0][1] == "0.75x (1,500 of 2,000)"  # 1500 / mean(1900, 2100)
    assert checks[1][1] == "0.39x (0.350 vs 0.900 ms)"
    assert checks[2][1] == "1.20x (2,400 vs 2,000)"
    text = render(results)
    assert "| heavy | V2 binary tensors | 256 | 1,500 |" in text
    assert "| 0.75x | 1.88x | 0.350 | 0.39x |" in text
    assert "**missed**" in text


def test_the_report_says_where_the_time_goes() -> None:
    text = render(_results())
    assert "| heavy | V2 binary tensors | 40.0 | 0.350 | 0.800 | 0.710 | 1.13x | 0.050 | 13% |" in (
        text
    )
    assert (
        "| light | TF-Serving JSON `/predict` | 40.0 | 0.500 | 0.800 | - | - | 0.050 | 13% |"
        in (text)
    )


def test_answers_of_each_protocol_are_read_as_their_client_would() -> None:
    want = np.array([[0.5, -1.25, 3.0]], dtype=np.float32)
    tf = orjson.dumps({"outputs": want.tolist()})
    assert decode_answer("tfserving", tf, {}).tolist() == [0.5, -1.25, 3.0]
    v2 = {
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 3], "data": [0.5, -1.25, 3.0]}]
    }
    assert decode_answer("v2-json", orjson.dumps(v2), {}).tolist() == [0.5, -1.25, 3.0]
    binary = {"name": "y", "datatype": "FP32", "shape": [1, 3]}
    binary["parameters"] = {"binary_data_size": 12}
    header = orjson.dumps({"outputs": [binary]})
    body = header + want.astype("<f4").tobytes()
    headers = {"Inference-Header-Content-Length": str(len(header))}
    assert decode_answer("v2-binary", body, headers).tolist() == [0.5, -1.25, 3.0]


def test_binary_body_is_the_json_header_then_the_raw_row() -> None:
    row = np.arange(4, dtype=np.float32)[None]
    body, headers = encode_body({"x": row}, "v2-binary")
    split = int(headers["Inference-Header-Content-Length"])
    assert orjson.loads(body[:split])["inputs"][0]["parameters"] == {"binary_data_size": 16}
    assert body[split:] == row.tobytes()


@pytest.mark.skipif(not have_wrk(), reason=f"the HTTP part drives wrk; {WRK_INSTALL_HINT}")
def test_protocols_bench_runs_on_a_tiny_setting(bench_on_session_ray: SuiteRun) -> None:
    port, grpc_port = free_ports(2)
    args = ["--workloads", "light", "--clients", "light=8", "--repeats", "1"]
    # No warm-up: the bench's own answer check has sent each protocol's route a request.
    args += ["--seconds", "1", "--warmup", "0", "--max-batch-size", "8"]
    args += ["--ceiling-seconds", "0.3", "--quiet-wait", "0"]
    # The shard actor is the session Ray's, not the server's child: to this bench it is other
    # people's work, so the noise rule (measure again while others use the cores) is off.
    args += ["--noise-retries", "0"]
    args += ["--port", str(port), "--grpc-port", str(grpc_port)]
    results = bench_on_session_ray.run("protocols", *args)
    runs = {r["protocol"]: r for r in results["runs"]}
    assert set(runs) == {"tfserving", "v2-json", "v2-binary", "grpc"}
    for run in runs.values():
        assert run["errors"] == 0
        assert run["rps"] > 0 and run["served"] >= run["requests"] > 0
        # The server process did the work of every answer: its CPU grew in each window.
        assert 0 < run["cpu_ms_per_request"] < 100
        assert 1 <= run["mean_batch_rows"] <= 8
        # The shard actor is the session Ray's here, not a child of the server: not counted.
        assert run["cores"]["frontend"] > 0
        assert run["frontend_ms_per_request"] > 0 and 0 <= run["idle_share"] <= 1
    assert runs["grpc"]["tool"] == "tritonclient.grpc.aio"
    assert results["ceiling"]["light"]["rows_per_s"] > 0
    assert results["ceiling"]["light"]["cpu_ms_per_row"] > 0
    table = bench_on_session_ray.table("protocols")
    assert "Where the time goes" in table
    assert "| light | V2 binary tensors | 8 |" in table
    assert "| target (issue 11) |" in table and "light c8, V2 binary" in table
    assert "| light | V2 gRPC (raw contents) |" in table.split("cores went")[1]
