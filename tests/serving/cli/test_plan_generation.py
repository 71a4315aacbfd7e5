"""`shardserve plan` on a keras_hub CausalLM preset: the cut into ranges of decoder blocks, each
stage's weights and KV cache, and the slot length's source."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from serving.cli.main import app
from tests.generation_models import GPT2_VOCABULARY

runner = CliRunner()


def test_plan_prints_the_block_cut_with_each_stages_kv_cache(llama_preset: Path) -> None:
    result = runner.invoke(app, ["plan", str(llama_preset), "--stages", "3"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "no position bound (RoPE): 2048 taken" in result.output
    rows = [line.split() for line in result.output.splitlines() if line[:1].isdigit()]
    assert [r[:3] for r in rows] == [["0", "[0,", "2)"], ["1", "[2,", "3)"], ["2", "[3,", "4)"]]
    # KV cache: 9 slots (8 + scratch) x 2048 x blocks x 2 x 2 kv heads x 8 x 4 bytes
    assert [" ".join(r[5:7]) for r in rows] == ["4.5 MiB", "2.2 MiB", "2.2 MiB"]
    assert "LM head, sampling" in result.output.splitlines()[-1]


def test_plan_refuses_a_slot_past_the_position_rows(gpt2_preset: Path) -> None:
    result = runner.invoke(
        app, ["plan", str(gpt2_preset), "--max-sequence-length", "64"], terminal_width=200
    )
    assert result.exit_code != 0
    assert "past the model's 32 position rows" in result.output


def test_plan_prints_a_split_heads_parts(gpt2_preset: Path) -> None:
    result = runner.invoke(
        app,
        ["plan", str(gpt2_preset), "--stages", "2", "--head-parts", "2"],
        terminal_width=200,
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[-3].endswith("+ final norm")
    vocab = len(GPT2_VOCABULARY)
    half = (vocab + 1) // 2  # the first slice takes the odd id
    assert lines[-2].split()[:4] == ["head", "0", "[0,", f"{half})"]
    assert lines[-1].split()[:4] == ["head", "1", f"[{half},", f"{vocab})"]
    assert "LM head rows, sampling its slice" in lines[-1]
    other = runner.invoke(app, ["plan", "demo-tiny", "--head-parts", "2"], terminal_width=200)
    assert other.exit_code != 0 and "--head-parts is for a generating model" in other.output
