"""The cluster's parts that need no Ray: capability text, node choice, GPU-node discovery, NodeLost."""

from __future__ import annotations

import pytest

from shared.errors import BackendUnavailable, InvalidArgument, NodeLost, WorkerLost, error_from_dict
from supervisor.cluster.capability import ClusterCapability
from supervisor.cluster.placement import NodeBudget, choose_node, gpu_nodes, require_gpu_nodes
from shared.spec import TenantSpec
from supervisor.store.registry import TenantRegistry


def _cc() -> ClusterCapability:
    registry, admin = TenantRegistry.new()
    try:
        cap = registry.register_with_capability(admin, TenantSpec("acme"))
    finally:
        registry.close()
    return ClusterCapability("twt", "acme", "ab" * 28, "tcp://127.0.0.1:4000", "k" * 40, cap.to_bytes(),
                             b"\x01" * 16, 2)


def test_cluster_capability_text_round_trip_and_secrecy() -> None:
    cc = _cc()
    text = cc.to_text()
    assert text.startswith("twtc1.") and str(cc) == text
    assert ClusterCapability.from_text(text) == cc
    assert cc.tenant_capability().tenant_id == "acme"
    assert "\\x01" not in repr(cc) and cc.capability.hex() not in repr(cc)
    moved = cc.moved({"node_id": "cd" * 28, "endpoint": "tcp://127.0.0.1:5000", "server_public_key": "m" * 40,
                      "capability": cc.capability, "epoch": 3})
    assert (moved.tenant_id, moved.ticket, moved.epoch, moved.endpoint) == ("acme", cc.ticket, 3, "tcp://127.0.0.1:5000")


@pytest.mark.parametrize("bad", ["", "twtc1.", "twtc1.!!!", "twtc2." + "A" * 20, "twtc1." + "A" * 5000, "twtc1.kQ"])
def test_malformed_cluster_capability_is_invalid_argument(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        ClusterCapability.from_text(bad)


def test_choose_node_most_free_budget_ties_by_fewer_tenants() -> None:
    budgets = [NodeBudget("a", True, 10, 8, 1), NodeBudget("b", True, 10, 2, 3), NodeBudget("c", False, 100, 0, 0)]
    assert choose_node(budgets) == "b"  # c has more room but is lost
    assert choose_node([NodeBudget("a", True, 10, 0, 2), NodeBudget("b", True, 10, 0, 1)]) == "b"
    assert choose_node(budgets, "a") == "a"
    with pytest.raises(InvalidArgument, match="no live supervisor"):
        choose_node(budgets, "c")
    with pytest.raises(BackendUnavailable, match="no live node"):
        choose_node([NodeBudget("c", False, 1, 0, 0)])


def test_only_alive_nodes_with_gpus_get_a_supervisor() -> None:
    nodes = [
        {"NodeID": "h", "Alive": True, "NodeManagerAddress": "127.0.0.1", "Resources": {"CPU": 1.0}},
        {"NodeID": "g2", "Alive": True, "NodeManagerAddress": "127.0.0.1", "Resources": {"GPU": 2.0}},
        {"NodeID": "g1", "Alive": True, "NodeManagerAddress": "127.0.0.1", "Resources": {"GPU": 1.0}},
        {"NodeID": "dead", "Alive": False, "NodeManagerAddress": "127.0.0.1", "Resources": {"GPU": 1.0}},
    ]
    assert [(n.node_id, n.gpus) for n in gpu_nodes(nodes)] == [("g1", 1.0), ("g2", 2.0)]
    with pytest.raises(BackendUnavailable, match="no node with GPUs") as exc:
        require_gpu_nodes(nodes[:1] + nodes[3:], "127.0.0.1:6379")
    assert "127.0.0.1:6379" in str(exc.value) and "1 alive node" in str(exc.value)


def test_node_lost_is_a_retryable_worker_lost_on_the_wire() -> None:
    err = NodeLost("acme", node_id="n1", reason="actor died")
    back = error_from_dict(err.to_dict())
    assert isinstance(back, NodeLost) and isinstance(back, WorkerLost)
    assert back.is_retryable() and back.node_id == "n1" and "buffers are gone" in str(back)


def test_gpus_column_counts_and_names_the_gpus() -> None:
    import io

    from supervisor.cli.cluster import gpus_cell, render

    assert gpus_cell([]) == "0" and gpus_cell(["0"]) == "1 (id 0)" and gpus_cell(["2", "3"]) == "2 (ids 2,3)"
    node = {"node_id": "n" * 20, "alive": True, "endpoint": "tcp://127.0.0.1:1", "gpu_ids": ["0"],
            "free_bytes": 1 << 30, "capacity_bytes": 1 << 30, "tenants": ["acme"]}
    out = io.StringIO()
    render({"cluster": "twt", "address": "127.0.0.1:6379", "ray_auth": "disabled", "nodes": [node],
            "tenants": [{"tenant_id": "acme", "node_id": node["node_id"], "state": "running",
                         "placement": "running", "instances": 2, "epoch": 0, "reason": ""}]}, out)
    text = out.getvalue()
    assert "1 (id 0)" in text and "ray auth disabled" in text and "without token authentication" in text
    row = [ln for ln in text.splitlines() if ln.startswith("acme")][0]
    assert row.split()[4] == "2"  # INST


def test_config_tenants_are_taken_out_of_the_node_config() -> None:
    from supervisor.cluster.ray_cluster import split_tenants

    doc = {"supervisor": {"backend": "stub"}, "tenant": [{"name": "acme", "instances": 2}, {"tenant_id": "b"}]}
    node_doc, tables = split_tenants(doc)
    assert node_doc == {"supervisor": {"backend": "stub"}, "tenant": []}  # no node registers them itself
    assert [TenantSpec.from_dict(t).tenant_id for t in tables] == ["acme", "b"]
    assert tables[0]["instances"] == 2 and doc["tenant"][0] == {"name": "acme", "instances": 2}  # not mutated


def test_cluster_cli_refuses_misplaced_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """Each action's arguments are checked before Ray is contacted (no Ray needed for these)."""
    from supervisor.cli import main

    for argv, needle in [
        (["cluster", "register"], "needs a TENANT"),
        (["cluster", "scale", "acme"], "needs TENANT and N"),
        (["cluster", "status", "acme"], "takes no TENANT"),
        (["cluster", "evict", "acme", "--gpu-cap", "1GiB"], "register's"),
        (["cluster", "status", "--config", "x.toml"], "go with cluster up"),
        (["cluster", "register", "acme", "--gpu-cap", "2Gb"], "bits"),
    ]:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own refusals
            code = int(exc.code or 0)
        assert code == 2, argv
        assert needle in capsys.readouterr().err, argv
