"""`shardserve plan`: the memory plan table, the same numbers `partition` writes into the
manifest; bad budgets refused with a clear message."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from serving.cli.main import app
from serving.cli.plan_table import plan_rows, split_lines
from shards.bundle.format import StageSpec, read_manifest
from shards.split import StagePart
from tests.shards.model_zoo import small_bert

runner = CliRunner()
OPTIONS = [
    "--max-stage-bytes",
    "800MiB",
    "--max-batch-size",
    "64",
    "--device-overhead-bytes",
    "700MiB",
]


def stage_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "dense_" in line or "logits" in line]


def test_plan_prints_what_partition_writes(tmp_path: Path) -> None:
    planned = runner.invoke(app, ["plan", "demo-mlp", *OPTIONS])
    assert planned.exit_code == 0, planned.output
    out = tmp_path / "bundle"
    written = runner.invoke(app, ["partition", "demo-mlp", "--out", str(out), *OPTIONS])
    assert written.exit_code == 0, written.output
    manifest = read_manifest(out)
    assert len(manifest.stages) > 1  # 126 MB of weights + 700 MiB overhead each: not one
    lines = stage_lines(planned.output)
    assert len(lines) == len(manifest.stages)
    for line, row in zip(lines, plan_rows(manifest.stages), strict=True):
        cells = [c.strip() for c in line.strip().strip("┃│").split("│")]
        assert tuple(cells) == row
    for spec in manifest.stages:
        assert spec.memory is not None and spec.memory.budget_bytes == 800 * 2**20
        assert spec.memory.plan_batch_rows == 64
        assert spec.planned_peak_bytes <= 800 * 2**20
    # A bundle directory: the plan in its manifest, the same table.
    again = runner.invoke(app, ["plan", str(out)])
    assert again.exit_code == 0, again.output
    assert stage_lines(again.output) == lines
    # Planned already: options that would plan it otherwise are refused.
    other = runner.invoke(app, ["plan", str(out), "--stages", "2"])
    assert other.exit_code == 1
    assert "is a bundle: its plan was made when it was partitioned" in " ".join(
        other.output.split()
    )


def test_plan_refuses_a_budget_without_a_number() -> None:
    result = runner.invoke(app, ["plan", "demo-tiny", "--max-stage-bytes", "lots"])
    assert result.exit_code == 2
    assert "cannot read 'lots' as a byte size" in result.output


def test_plan_names_the_layer_that_fits_nowhere() -> None:
    result = runner.invoke(
        app,
        ["plan", "demo-mlp", "--max-stage-bytes", "10MiB,10MiB", "--device-overhead-bytes", "0"],
    )
    assert result.exit_code == 1
    text = " ".join(result.output.split())  # rich wraps the error at the console's width
    assert "layer 'dense_1' alone holds 16.0 MiB of weights" in text
    assert "the largest device budget 10485760 (10.0 MiB)" in text
    assert "Traceback" not in text


def test_plan_refuses_a_savedmodel_or_nothing(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", str(tmp_path / "nothing.onnx")])
    assert result.exit_code == 1
    assert "cannot plan" in result.output and "demo-mlp" in result.output


def test_plan_prints_the_models_own_bound_and_refuses_a_length_over_it(tmp_path: Path) -> None:
    model = tmp_path / "bert.keras"
    small_bert(32).save(model)
    out = tmp_path / "bundle"
    written = runner.invoke(app, ["partition", str(model), "--out", str(out)])
    assert written.exit_code == 0, written.output
    for source in (str(model), str(out)):  # planned now, or the plan in the manifest
        planned = runner.invoke(app, ["plan", source])
        assert planned.exit_code == 0, planned.output
        text = " ".join(planned.output.split())
        assert "max sequence length 32, the model's own bound (positions: token_ids 32)" in text
        assert "counted as 32 (--max-sequence-length)" in text
    over = runner.invoke(app, ["plan", str(model), "--max-sequence-length", "64"])
    assert over.exit_code == 1
    assert "max_sequence_length=64 is over 32" in " ".join(over.output.split())


def test_plan_says_which_actors_hold_a_tied_table_once() -> None:
    def stage(index: int, label: str, use: str | None, held_by: int | None) -> StageSpec:
        part = StagePart("tokens", "ReversibleEmbedding", "rows", index % 3, 2, 0, 1, use, held_by)
        return StageSpec(index, f"s{index}.keras", (), (), 0, 0, part=part, label=label)

    middle = StageSpec(2, "s2.keras", (), (), 0, 0, label="1")
    stages = [
        stage(0, "0.0", None, None),
        stage(1, "0.1", None, None),
        middle,
        stage(3, "2.0", "logits", 0),
        stage(4, "2.1", "logits", 1),
    ]
    lookups, logits = split_lines(stages)
    assert "split by rows (vocabulary ranges) into 2 parts on stages 0.0, 0.1" in lookups
    assert logits.startswith(
        "tokens (ReversibleEmbedding) logits: held once, stages 2.0, 2.1 run by the actors of "
        "0.0, 0.1"
    )
