"""`python -m bench datapath` on a tiny U-Net in 4 stages: bytes per batch by routing and dtype."""

from __future__ import annotations

from tests.bench.suiterun import SuiteRun


def test_datapath_bench_counts_the_bytes_of_each_routing(bench: SuiteRun) -> None:
    modes = "dicts,tensors,tensors+bf16"
    args = ["--models", "unet", "--image", "16", "--stages", "4", "--batch", "2"]
    args += ["--batches", "2", "--rounds", "1", "--modes", modes, "--unet-modes", modes]
    # A child: the bench starts a local Ray of its own.
    unet = bench.run("datapath", *args, child=True)["unet"]
    moved = {mode: unet[mode]["bytes_per_batch"] for mode in modes.split(",")}
    # A skip from stage 0 to stage 2 no longer brings stage 0's other outputs along.
    assert moved["tensors"] < moved["dicts"]
    # Cut tensors in 2 bytes; the request and the model output stay float32.
    assert moved["tensors"] / 2 < moved["tensors+bf16"] < moved["tensors"] * 0.6
    assert unet["tensors"]["accuracy"]["max_abs"] == 0.0
    assert 0 < unet["tensors+bf16"]["accuracy"]["max_rel"] < 0.05
    assert "| unet | tensors+bf16 |" in bench.table("datapath")
