"""Reading a preset without TensorFlow: what generates, the families, the cut, the KV cache."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shards.errors import PlanError, ResolveError
from shards.generation import is_generating_model
from shards.generation.partition import (
    cut_blocks,
    kv_cache_bytes,
    plan_generation,
    resolve_max_length,
)
from shards.generation.preset import DEFAULT_MAX_LENGTH, read_preset, special_tokens
from tests.generation_models import GPT2_VOCABULARY


def _fake_preset(path: Path, backbone: str, tasks: list[str]) -> Path:
    path.mkdir()
    (path / "metadata.json").write_text(json.dumps({"tasks": tasks}))
    (path / "config.json").write_text(
        json.dumps({"class_name": backbone, "config": {"num_layers": 2, "hidden_dim": 8}})
    )
    (path / "task.json").write_text(json.dumps({"config": {"preprocessor": None}}))
    return path


def test_supported_presets_generate_and_others_do_not(
    gpt2_preset: Path, llama_preset: Path, tmp_path: Path
) -> None:
    assert is_generating_model(str(gpt2_preset))
    assert is_generating_model(str(llama_preset))
    assert not is_generating_model(
        str(_fake_preset(tmp_path / "bert", "BertBackbone", ["MaskedLM"]))
    )
    assert not is_generating_model(str(tmp_path / "missing"))
    assert not is_generating_model(str(gpt2_preset / "config.json"))


def test_another_family_is_refused_by_name_with_the_ones_that_work(tmp_path: Path) -> None:
    path = _fake_preset(tmp_path / "opt", "OPTBackbone", ["CausalLM"])
    assert not is_generating_model(str(path))
    with pytest.raises(
        ResolveError,
        match="'OPTBackbone' cannot generate here; supported: GPT2Backbone, LlamaBackbone",
    ):
        read_preset(str(path))


def test_is_generating_model_imports_no_tensorflow(gpt2_preset: Path) -> None:
    code = (
        "import sys; from shards.generation import is_generating_model; "
        f"assert is_generating_model({str(gpt2_preset)!r}); "
        "print(sorted(m for m in ('tensorflow', 'keras', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_what_the_presets_say(gpt2_preset: Path, llama_preset: Path) -> None:
    gpt2 = read_preset(str(gpt2_preset))
    assert (gpt2.family, gpt2.num_layers, gpt2.kv_heads, gpt2.head_dim) == ("gpt2", 4, 2, 16)
    assert gpt2.vocabulary_size == len(GPT2_VOCABULARY)
    assert gpt2.max_length_bound == 32 and gpt2.default_max_length == 32
    assert gpt2.tokenizer_kind == "byte_bpe" and gpt2.add_start_token
    assert gpt2.tokenizer_dir is not None
    assert (Path(gpt2.tokenizer_dir) / "vocabulary.json").is_file()
    end = GPT2_VOCABULARY["<|endoftext|>"]
    assert special_tokens(gpt2) == ((end,), end)

    llama = read_preset(str(llama_preset))
    assert (llama.family, llama.kv_heads, llama.head_dim) == ("llama", 2, 8)
    # RoPE has no position bound of its own: the slot length defaults to 2,048.
    assert llama.max_length_bound is None and llama.default_max_length == DEFAULT_MAX_LENGTH
    assert llama.tokenizer_kind == "sentencepiece" and llama.add_start_token
    assert llama.tokenizer_dir is not None
    assert (Path(llama.tokenizer_dir) / "vocabulary.spm").is_file()
    assert special_tokens(llama) == ((3,), 2)  # </s>, <s> as the tokenizer was trained


def test_a_preset_saved_without_preprocessor_serves_token_ids_only(
    llama_preset: Path, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(llama_preset, bare, ignore=shutil.ignore_patterns("assets", "*.weights.h5"))
    task = json.loads((bare / "task.json").read_text())
    task["config"]["preprocessor"] = None
    (bare / "task.json").write_text(json.dumps(task))
    spec = read_preset(str(bare))
    assert spec.tokenizer_dir is None and spec.tokenizer_kind is None and not spec.add_start_token
    assert special_tokens(spec) == ((), None)


def test_max_sequence_length_is_held_to_the_position_rows(gpt2_preset: Path) -> None:
    spec = read_preset(str(gpt2_preset))
    assert resolve_max_length(spec, None) == 32
    assert resolve_max_length(spec, 16) == 16
    with pytest.raises(PlanError, match="past the model's 32 position rows"):
        resolve_max_length(spec, 33)


def test_blocks_are_cut_evenly() -> None:
    assert [(c.first, c.last) for c in cut_blocks(4, 2)] == [(0, 2), (2, 4)]
    assert [(c.first, c.last) for c in cut_blocks(5, 3)] == [(0, 2), (2, 4), (4, 5)]
    assert [c.blocks for c in cut_blocks(12, 1)] == [12]
    with pytest.raises(PlanError, match="between 1 and the model's 4 decoder blocks, got 5"):
        cut_blocks(4, 5)


def test_the_kv_cache_counts_slots_length_blocks_kv_heads(llama_preset: Path) -> None:
    spec = read_preset(str(llama_preset))
    # (8 slots + the scratch slot) x 32 positions x 2 blocks x (k, v) x 2 kv heads x 8 x 4 bytes
    assert kv_cache_bytes(spec, blocks=2, kv_slots=8, max_length=32) == 9 * 32 * 2 * 2 * 2 * 8 * 4


def test_resolve_says_a_preset_generates_instead_of_cutting_it(
    gpt2_preset: Path, tmp_path: Path
) -> None:
    from shards.source.resolve import ResolveOptions, resolve_bundle

    options = ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=tmp_path / "cache")
    with pytest.raises(ResolveError, match="GPT2Backbone preset: it is served by generation"):
        resolve_bundle(str(gpt2_preset), options)
    other = _fake_preset(tmp_path / "opt", "OPTBackbone", ["CausalLM"])
    with pytest.raises(ResolveError, match="supported: GPT2Backbone, LlamaBackbone"):
        resolve_bundle(str(other), options)


def test_one_stage_holds_the_presets_parameter_count(gpt2_preset: Path, llama_preset: Path) -> None:
    for preset in (gpt2_preset, llama_preset):
        spec = read_preset(str(preset))
        counted = json.loads((preset / "metadata.json").read_text())["parameter_count"]
        (plan,) = plan_generation(spec, 1, kv_slots=2, max_length=8)
        assert plan.weight_bytes == counted * 4


def test_a_split_head_leaves_the_last_stage_and_its_parts_hold_the_vocabulary(
    gpt2_preset: Path,
) -> None:
    from shards.generation.partition import describe_plan, head_part_params

    spec = read_preset(str(gpt2_preset))
    whole = plan_generation(spec, 2, kv_slots=2, max_length=8)
    split = plan_generation(spec, 2, kv_slots=2, max_length=8, head_parts=2)
    rows = (spec.vocabulary_size - 1) * spec.hidden_dim * 4
    assert split[0] == whole[0]  # the first stage keeps the table for its lookup
    assert split[1].weight_bytes == whole[1].weight_bytes - rows
    assert sum(head_part_params(spec, 2)) == spec.vocabulary_size * spec.hidden_dim
    lines = describe_plan(spec, split, 2, 8, head_parts=2)
    assert "final norm" in lines[-3] and "LM head" not in lines[-3]
    assert lines[-2].startswith("head 0") and lines[-1].startswith("head 1")
