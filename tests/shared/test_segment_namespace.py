"""Segment names carry their run dir's namespace; a namespaced cleanup leaves other run dirs alone."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from shared import quota
from shared.quota import (
    NAME_MAX,
    cleanup_stale_segments,
    is_legacy_name,
    namespace_of,
    new_segment_name,
    segment_namespace,
    stale_segments,
)
from shared.region import region_name
from tests.helpers import segments as fab

pytestmark = pytest.mark.timeout(60)


def test_namespace_is_stable_per_real_path_and_differs_between_run_dirs(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (tmp_path / "link").symlink_to(a)
    ns = segment_namespace(str(a))
    assert ns == segment_namespace(str(a) + "/") == segment_namespace(str(tmp_path / "link"))  # the real path
    assert ns == segment_namespace(str(a))  # a restart on the same run dir: the same namespace
    assert ns != segment_namespace(str(b))
    assert ns.startswith("ns") and len(ns) == 14 and namespace_of(f"twt-{ns}-0a1b2c3d-7") == ns


@pytest.mark.parametrize(
    ("name", "namespace", "legacy"),
    [
        ("twt-ns0123456789ab-deadbeef-0", "ns0123456789ab", False),
        ("twt-ns0123456789ab-deadbeef-dev3", "ns0123456789ab", False),
        ("twt-ns0123456789ab-deadbeef-r" + "f" * 32, "ns0123456789ab", False),
        ("twt-deadbeef-0", None, True),  # what a supervisor made before namespaces
        ("twt-deadbeef-12", None, True),
        ("twt-deadbeef-dev0", None, True),
        ("twt-deadbeef-r" + "0" * 32, None, True),
        ("twt-0123456789ab-0", None, False),  # QuotaBlock.create()'s default: not a supervisor's
        ("twt-tabc123-0", None, False),  # a test's prefix
        ("twt-ns0123456789a-x-0", None, False),  # one digit short
        ("twt-nsABCDEF012345-x-0", None, False),  # not lowercase hex
        ("twt-deadbeef-r00", None, False),
        ("psm_deadbeef", None, False),
    ],
)
def test_names_are_told_apart(name: str, namespace: str | None, legacy: bool) -> None:
    assert namespace_of(name) == namespace
    assert is_legacy_name(name) is legacy


def test_names_stay_within_name_max() -> None:
    ns = segment_namespace("/run/twt")
    prefix = f"{ns}-{secrets.token_hex(4)}"
    longest = max(new_segment_name(prefix, quota.MAX_INSTANCES * 1000), new_segment_name(prefix, "dev1023"),
                  region_name(prefix), key=len)
    assert len(longest) == len(f"twt-{prefix}-r") + 32 == 61 <= NAME_MAX
    with pytest.raises(ValueError, match="NAME_MAX"):
        new_segment_name("p" * NAME_MAX)
    with pytest.raises(ValueError, match="longer than 255"):
        region_name("p" * 230)
    with pytest.raises(ValueError, match="not a segment namespace"):
        cleanup_stale_segments(namespace="twt-abc")


def test_namespaced_cleanup_removes_own_and_legacy_only(tmp_path: Path) -> None:
    mine, other = segment_namespace(str(tmp_path / "mine")), segment_namespace(str(tmp_path / "other"))
    dead = fab.dead_owner()
    me = (os.getpid(), quota.process_start_ms(os.getpid()))
    own_stale = [fab.namespaced_name(mine, "0"), fab.namespaced_name(mine, "dev0")]
    own_live = fab.namespaced_name(mine, "1")
    other_stale = fab.namespaced_name(other, "0")
    legacy = f"twt-{secrets.token_hex(4)}-0"
    test_made = f"twt-t{secrets.token_hex(5)}-0"  # unnamespaced, not a supervisor's shape
    made = [*own_stale, own_live, other_stale, legacy, test_made]
    try:
        for name in own_stale:
            fab.write_stale(name, dead, kind=quota.KIND_DEVICE if name.endswith("dev0") else quota.KIND_TENANT)
        fab.write_stale(own_live, me)
        for name in (other_stale, legacy, test_made):
            fab.write_stale(name, dead)
        # Return values, not existence, say who removed what: a parallel test run of an older build
        # (before namespaces) removes every dead owner's segment at its supervisors' starts.
        listed = {h.name for h in stale_segments(namespace=mine)}
        assert listed <= {*own_stale, legacy}
        removed = cleanup_stale_segments(namespace=mine)
        assert set(removed) <= {*own_stale, legacy} and not any(map(fab.exists, [*own_stale, legacy]))
        assert fab.exists(own_live)  # its owner is alive: no cleanup ever takes it
        assert cleanup_stale_segments(namespace=mine) == []  # idempotent
        # the other run dir's start removes its own; a prefix-wide (namespace-blind) cleanup the rest
        assert set(cleanup_stale_segments(namespace=other)) <= {other_stale, legacy}
        assert set(cleanup_stale_segments(test_made)) <= {test_made}
        assert not fab.exists(other_stale) and not fab.exists(test_made) and fab.exists(own_live)
    finally:
        fab.remove(*made)
