"""Version policies with Triton's and TF Serving's meaning: latest n, all, specific."""

from __future__ import annotations

import pytest

from serving.repository.version_policy import VersionPolicy


def test_latest_serves_the_n_highest_versions() -> None:
    assert VersionPolicy().select([3, 1, 10, 2]) == [10]
    assert VersionPolicy("latest", n=2).select([3, 1, 10, 2]) == [3, 10]
    assert VersionPolicy("latest", n=5).select([2, 1]) == [1, 2]
    assert VersionPolicy().select([]) == []


def test_all_serves_every_version_sorted() -> None:
    assert VersionPolicy("all").select({4, 1, 2}) == [1, 2, 4]


def test_specific_serves_the_listed_versions_on_disk_and_names_the_rest() -> None:
    policy = VersionPolicy("specific", versions=(5, 1, 3, 3))
    assert policy.versions == (1, 3, 5)
    assert policy.select([1, 2, 3, 4]) == [1, 3]
    assert policy.missing([1, 2, 3, 4]) == [5]
    assert VersionPolicy("latest").missing([1]) == []


def test_describe_is_one_short_line() -> None:
    assert VersionPolicy("latest", n=2).describe() == "latest 2"
    assert VersionPolicy("all").describe() == "all"
    assert VersionPolicy("specific", versions=(3, 1)).describe() == "specific [1, 3]"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"policy": "newest"},
            "policy must be one of \\['latest', 'all', 'specific'\\], got 'newest'",
        ),
        ({"n": 0}, "n must be an integer >= 1 .*: 0"),
        ({"n": True}, "n must be an integer >= 1"),
        ({"policy": "specific"}, 'policy "specific" needs versions'),
        ({"policy": "specific", "versions": (1, 0)}, "versions must be positive integers"),
        ({"policy": "all", "versions": (1,)}, 'only read with policy = "specific"'),
    ],
)
def test_bad_policies_name_the_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VersionPolicy(**kwargs)  # type: ignore[arg-type]
