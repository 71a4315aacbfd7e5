"""How the server sizes its private Ray before starting it: the stages each version will have
(guessed before the model is cut) and the logical CPUs that hold them all and one more; and
when a small single stage takes the cores as single-threaded replicas."""

from __future__ import annotations

import json
from pathlib import Path

from serving.settings.config import Settings
from serving.version.runner import estimated_stages, private_ray_cpus, stage_replicas
from shards.bundle.format import read_manifest
from shards.cpu_plan import available_memory, machine_cores, stage_copies
from shards.source.resolve import ResolveOptions, resolve_bundle


def test_the_stages_are_known_from_the_settings_a_bundle_or_the_weights_over_a_budget(
    tmp_path: Path,
) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"stages": [{}, {}, {}]}))
    weights = tmp_path / "big.keras"
    weights.write_bytes(b"\0" * 2500)

    assert estimated_stages(Settings(model="demo-tiny", stages=4)) == 4
    assert estimated_stages(Settings(model=str(bundle))) == 3
    assert estimated_stages(Settings(model=str(weights), max_stage_bytes=[1000])) == 3
    assert estimated_stages(Settings(model="demo-tiny", max_stage_bytes=[10, 20])) == 2
    assert estimated_stages(Settings(model="demo-tiny")) == 1


def test_two_models_each_get_their_cpus_and_one_more_fits() -> None:
    cores = machine_cores()
    one = Settings(model="demo-tiny", stages=2)
    two = Settings(model="demo-mlp", stages=2, replicas=2)
    # Each stage asks the whole threads of its share of the cores (at least one).
    asks = [2 * max(1, cores // 2), 4 * max(1, cores // 4)]

    assert private_ray_cpus([one, two]) == sum(asks) + max([cores, *asks])


def test_the_server_copies_a_small_single_stage_only_where_the_choice_is_its_own(
    tmp_path: Path,
) -> None:
    bundle = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=1, max_stage_bytes=None, cache_dir=tmp_path)
    )
    cores = machine_cores()
    peak = read_manifest(bundle).stages[0].planned_peak_bytes
    copies = stage_copies(1, peak, cores, available_memory())
    model = str(bundle)

    replicas = {"model": model, "stage_cores": "replicas"}

    assert stage_replicas(Settings(model=model), bundle) == 1  # the default: threads
    assert stage_replicas(Settings(**replicas), bundle) == copies
    assert stage_replicas(Settings(**replicas, replicas=1), bundle) == 1  # a count given
    assert stage_replicas(Settings(**replicas, cpus_per_shard=1), bundle) == 1
    assert stage_replicas(Settings(**replicas, max_stage_bytes=[2**40]), bundle) == 1
    assert stage_replicas(Settings(**replicas, ray_address="auto"), bundle) == 1
    assert stage_replicas(Settings(**replicas, min_replicas=1, max_replicas=2), bundle) == 1
    two = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    )
    assert stage_replicas(Settings(model=str(two), stage_cores="replicas"), two) == 1
