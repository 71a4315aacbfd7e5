from pathlib import Path

import pytest

from serving.settings.config import ConfigError, Settings, load_settings
from serving.version.runner import pipeline_options
from serving.version.served import batch_settings
from tests.fakes import FakeRunner


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in __import__("os").environ if k.startswith("SHARDSERVE_")]:
        monkeypatch.delenv(name)


def test_defaults() -> None:
    s = load_settings()
    assert (s.max_batch_size, s.batch_timeout_ms, s.request_timeout_ms) == (32, "auto", 30000.0)
    assert s.timeout_is_auto  # issue 38: the adaptive wait beat a fixed 5 ms at every load measured
    assert s.padded_sizes() == (1, 2, 4, 8, 16, 32)
    assert s.max_body_bytes == 16 * 1024 * 1024
    assert s.admin_token is None
    # in-flight defaults to the pipeline depth plus one batch per pipeline being handed over;
    # the queue to 4 x batch x in-flight
    assert s.inflight_batches(3) == 4
    assert s.inflight_batches(2, replicas=3) == 9
    assert s.queue_rows(3) == 4 * 32 * 4
    assert load_settings(max_inflight_batches=2).inflight_batches(3) == 2
    assert s.max_sequence_length is None  # the model's own bound, else 512, once it loads


def test_flag_beats_env_beats_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "s.toml"
    cfg.write_text('max-batch-size = 8\nbatch_timeout_ms = 7\nport = 9000\nmodel = "demo-tiny"\n')
    monkeypatch.setenv("SHARDSERVE_MAX_BATCH_SIZE", "16")
    monkeypatch.setenv("SHARDSERVE_PORT", "9100")
    s = load_settings(cfg, max_batch_size="64")
    assert s.max_batch_size == 64  # flag
    assert s.port == 9100  # env over file
    assert s.batch_timeout_ms == 7.0  # file over default
    assert s.model == "demo-tiny"


def test_lists_from_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSERVE_IMPORTS", "mylayers, other.mod")
    s = load_settings(allowed_batch_sizes="1,8,32", stage_resources='[{"node_a": 1}, {"b": 2}]')
    assert s.imports == ["mylayers", "other.mod"]
    assert s.padded_sizes() == (1, 8, 32)
    assert s.stage_resources == [{"node_a": 1.0}, {"b": 2.0}]


def test_auto_timeout() -> None:
    assert load_settings(batch_timeout_ms="auto").timeout_is_auto
    assert load_settings(batch_timeout_ms="0").batch_timeout_ms == 0.0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"max_batch_size": "0"},
            "max_batch_size: Input should be greater than or equal to 1 (got '0')",
        ),
        (
            {"batch_timeout_ms": "-3"},
            "batch_timeout_ms: must be a number of ms between 0 and 60000",
        ),
        ({"batch_timeout_ms": "soon"}, "(got 'soon')"),
        ({"port": "70000"}, "port: Input should be less than or equal to 65535"),
        ({"stages": 2, "max_stage_bytes": 100}, "either stages or max_stage_bytes"),
        ({"allowed_batch_sizes": "1,64"}, "between 1 and max_batch_size (32), got [1, 64]"),
        ({"max_queue_rows": "8"}, "max_queue_rows (8) must be >= max_batch_size (32)"),
        ({"placement_strategy": "RANDOM"}, "placement_strategy"),
        (
            {"max_sequence_length": "0"},
            "max_sequence_length: Input should be greater than or equal to 1 (got '0')",
        ),
        ({"no_such_setting": 1}, "no_such_setting: unknown setting"),
    ],
)
def test_validation_names_field_value_and_range(overrides: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)
    assert expected in str(info.value)


def test_config_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("max_batch_size = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("max_batch = 3\n")
    with pytest.raises(ConfigError, match=r"unknown settings \['max_batch'\]"):
        load_settings(unknown)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "missing.toml")


def test_served_name() -> None:
    assert Settings(model="/models/resnet.keras").served_name() == "resnet"
    assert Settings(model="demo-mlp").served_name() == "demo-mlp"
    assert Settings(model="x.keras", model_name="prod").served_name() == "prod"


def test_the_served_policy_knows_the_pipeline_depth() -> None:
    runner = FakeRunner()
    runner.num_stages = 3
    runner.replicas = 2  # type: ignore[attr-defined]
    policy = batch_settings(load_settings(batch_timeout_ms="auto"), runner)
    # the auto policy spreads rows over the 6 batches computed at once, not the 8 slots
    assert (policy.pipeline_depth, policy.max_inflight_batches, policy.is_auto) == (6, 8, True)


def test_a_split_layers_parts_count_once_in_the_pipeline_depth() -> None:
    runner = FakeRunner()
    runner.num_stages = 3  # "0.0", "0.1" (one layer's parts, side by side) and "1"
    runner.pipeline_depth = 2  # type: ignore[attr-defined]
    runner.replicas = 2  # type: ignore[attr-defined]
    policy = batch_settings(load_settings(batch_timeout_ms="auto"), runner)
    assert policy.pipeline_depth == 4


def test_batches_are_padded_on_gpu_stages_or_when_sizes_are_given_not_on_cpu() -> None:
    cpu, gpu = FakeRunner(), FakeRunner()
    gpu.on_gpu = True  # type: ignore[misc]
    default = load_settings()
    assert not batch_settings(default, cpu).pad_batches
    assert batch_settings(default, cpu).padded_size(17) == 17
    assert batch_settings(default, gpu).padded_size(17) == 32
    given = load_settings(allowed_batch_sizes="8,24")
    assert batch_settings(given, cpu).padded_size(17) == 24
    # The actors warm up at every bucket either way: on a GPU each is a shape to prepare.
    assert default.padded_sizes() == (1, 2, 4, 8, 16, 32)


def test_shard_actor_options_follow_the_settings() -> None:
    plain = pipeline_options(load_settings(max_batch_size=8))
    assert (plain.compiled_graph, plain.max_inflight_per_replica, plain.batch_sizes) == (
        False,
        None,
        (1, 2, 4, 8),
    )
    compiled = pipeline_options(load_settings(compiled_graph="true", max_inflight_batches=5))
    assert (compiled.compiled_graph, compiled.max_inflight_per_replica) == (True, 5)


def test_replica_placement_waits_as_long_as_the_load_budget() -> None:
    # The inner placement wait once stopped a load at 300 s, before load_timeout_s (600 s)
    # could name what it waited for.
    assert pipeline_options(load_settings()).ready_timeout_s == 600.0
    assert pipeline_options(load_settings(load_timeout_s=1200)).ready_timeout_s == 1200.0


def test_the_admin_token_comes_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mounted Kubernetes secret: off the command line, out of the environment."""
    secret = tmp_path / "token"
    secret.write_text("s3cret-token\n")  # as `kubectl create secret --from-file` keeps it
    token = load_settings(admin_token_file=str(secret)).admin_token
    assert token is not None and token.get_secret_value() == "s3cret-token"
    monkeypatch.setenv("SHARDSERVE_ADMIN_TOKEN_FILE", str(secret))
    from_env = load_settings()
    assert from_env.admin_token is not None
    assert from_env.admin_token.get_secret_value() == "s3cret-token"
    # A version's settings copy every field of the server's (serving.repository.model_config).
    copied = Settings(**{k: getattr(from_env, k) for k in Settings.model_fields})
    assert copied.admin_token == from_env.admin_token


def test_a_bad_admin_token_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"admin_token_file '.*nope'.*No such file"):
        load_settings(admin_token_file=str(tmp_path / "nope"))
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(ConfigError, match=r"admin_token_file '.*empty' is empty"):
        load_settings(admin_token_file=str(tmp_path / "empty"))
    (tmp_path / "token").write_text("one")
    with pytest.raises(ConfigError, match="either admin_token or admin_token_file, not both"):
        load_settings(admin_token="two", admin_token_file=str(tmp_path / "token"))
