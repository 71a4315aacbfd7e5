"""Whether more replicas fit in what the cluster has free now (``shards.capacity``): the packing
of one placement group onto the nodes' free resources by its strategy (pure), and the look at
the session's real Ray."""

from __future__ import annotations

from shards.capacity import place_group, replicas_fit

STAGES = [{"CPU": 1.0}, {"CPU": 1.0}]


def test_a_group_takes_its_resources_off_the_nodes_it_lands_on() -> None:
    nodes = [{"CPU": 1.0}, {"CPU": 2.0}]
    assert place_group(STAGES, nodes, "PACK")
    assert nodes == [{"CPU": 0.0}, {"CPU": 1.0}]
    assert place_group([{"CPU": 1.0}], nodes, "PACK")
    assert not place_group([{"CPU": 1.0}], nodes, "PACK")  # the cluster is full
    assert nodes == [{"CPU": 0.0}, {"CPU": 0.0}]  # left as it was


def test_the_strict_strategies_keep_their_shape() -> None:
    apart = [{"CPU": 1.5}, {"CPU": 1.5}]
    assert not place_group(STAGES, [dict(n) for n in apart], "STRICT_PACK")  # 2 CPUs, one node
    assert place_group(STAGES, [{"CPU": 2.0}], "STRICT_PACK")
    assert not place_group(STAGES, [{"CPU": 4.0}], "STRICT_SPREAD")  # a node per stage
    assert place_group(STAGES, [{"CPU": 1.0}, {"CPU": 1.0}], "STRICT_SPREAD")


def test_the_session_cluster_says_what_does_not_fit(ray_address: str) -> None:
    assert replicas_fit([{"CPU": 0.001}], 2) is None
    why = replicas_fit([{"CPU": 0.001, "shardserve_nowhere": 1.0}], 3)
    assert why is not None and "\n" not in why
    assert why.startswith("3 replica(s) ask CPU=0.003, shardserve_nowhere=3 (PACK); 0 of them fit")
