"""`shardserve partition`: writes a bundle, refuses bad options with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from serving.cli.main import app

runner = CliRunner()


def test_partition_writes_a_bundle(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    result = runner.invoke(app, ["partition", "demo-tiny", "--stages", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["stages"]) == 2
    assert all((out / stage["file"]).exists() for stage in manifest["stages"])
    assert "wrote 2 stage(s)" in result.output


def test_partition_refuses_both_ways_of_asking(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "partition",
            "demo-tiny",
            "--stages",
            "2",
            "--max-stage-bytes",
            "10",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 2
    assert "either --stages or --max-stage-bytes" in result.output


def test_partition_names_an_oversized_layer(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["partition", "demo-tiny", "--max-stage-bytes", "16", "--out", str(tmp_path / "b")]
    )
    assert result.exit_code == 1
    assert "error:" in result.output and "16" in result.output


def test_plan_says_the_length_an_unknown_dimension_is_counted_at(tmp_path: Path) -> None:
    import keras

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(100, 8, mask_zero=True, name="emb")(tokens)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    keras.Model(tokens, keras.layers.Dense(2, name="out")(x)).save(tmp_path / "tokens.keras")
    model = str(tmp_path / "tokens.keras")
    default = runner.invoke(app, ["plan", model, "--stages", "2"])
    assert default.exit_code == 0, default.output
    assert "counted as 512 (--max-sequence-length)" in " ".join(default.output.split())
    short = runner.invoke(app, ["plan", model, "--stages", "2", "--max-sequence-length", "64"])
    assert short.exit_code == 0, short.output
    assert "counted as 64 (--max-sequence-length)" in " ".join(short.output.split())
    # A bundle says the length it was planned at.
    out = tmp_path / "bundle"
    cut = ["partition", model, "--out", str(out), "--max-sequence-length", "32"]
    assert runner.invoke(app, cut).exit_code == 0
    planned = runner.invoke(app, ["plan", str(out)])
    assert "counted as 32 (--max-sequence-length)" in " ".join(planned.output.split())
    assert "counted as" not in runner.invoke(app, ["plan", "demo-tiny"]).output


def test_the_lookup_combine_is_chosen_by_its_flag(tmp_path: Path) -> None:
    # The recommender's item table, too large for the budget, split by rows in 2: routed by
    # default (each part writes per id tensor its vectors and their positions), dense when
    # asked (the whole lookups); a value outside the choices is refused naming them.
    from shards.bundle.format import read_manifest
    from shards.partition.demo_models import demo_recommender

    demo_recommender().save(tmp_path / "rec.keras")
    budget = ["--max-stage-bytes", "600KB", "--max-batch-size", "8", "--device-overhead-bytes", "0"]
    shapes = {}
    for combine in ("routed", "dense", None):
        out = tmp_path / f"bundle-{combine}"
        chosen = [] if combine is None else ["--lookup-combine", combine]
        cut = [*budget, *chosen, "--out", str(out)]
        result = runner.invoke(app, ["partition", str(tmp_path / "rec.keras"), *cut])
        assert result.exit_code == 0, result.output
        shapes[combine] = [tuple(t.shape) for t in read_manifest(out).stages[0].outputs]
    assert shapes["routed"] == shapes[None] == [(32,), (), (32,), ()]
    assert shapes["dense"] == [(20, 32), (1, 32)]
    planned = runner.invoke(app, ["plan", str(tmp_path / "rec.keras"), *budget])
    dense = runner.invoke(
        app, ["plan", str(tmp_path / "rec.keras"), *budget, "--lookup-combine", "dense"]
    )
    assert planned.exit_code == dense.exit_code == 0, planned.output + dense.output
    assert "items rows [0, 3000)" in planned.output and "items rows [0, 3000)" in dense.output
    bad = runner.invoke(app, ["plan", "demo-tiny", "--lookup-combine", "sparse"])
    assert bad.exit_code == 2
    text = " ".join(bad.output.replace("│", " ").split())  # rich boxes the error
    assert "'sparse' is not one of 'routed', 'dense'" in text
