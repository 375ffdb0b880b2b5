"""Hostile reload files are ConfigError, never an internal error: nesting 10,000 deep."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shared import config
from shared.config import MAX_CONFIG_DEPTH, read_config_file
from shared.errors import ConfigError
from shared.spec import TenantSpec
from tests.helpers.cluster import supervisor

pytestmark = pytest.mark.timeout(120)

DEEP = 10_000


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_file_nested_too_deeply_is_a_config_error(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"twt{suffix}"
    nested = "[" * DEEP + "]" * DEEP
    path.write_text(f'{{"supervisor": {{"x": {nested}}}}}' if suffix == ".json" else f"[supervisor]\nx = {nested}\n")
    with pytest.raises(config.ConfigError, match="nested too deeply"):
        read_config_file(path)
    # parsed fine, but deeper than any config: refused before any recursive check sees it
    deep_doc: object = []
    for _ in range(MAX_CONFIG_DEPTH + 5):
        deep_doc = [deep_doc]
    if suffix == ".json":
        path.write_text(json.dumps({"supervisor": {"x": deep_doc}}))
        with pytest.raises(config.ConfigError, match="levels deep"):
            read_config_file(path)


def test_reload_of_a_ten_thousand_deep_file_is_refused_and_changes_nothing() -> None:
    with supervisor([{"name": "a"}]) as sup:
        c = sup.client
        config = os.path.join(sup.run_dir, "launch-config.json")
        assert os.path.exists(config)
        c.register(None, TenantSpec("r"))
        Path(config).write_text('{"supervisor": ' + "[" * DEEP + "]" * DEEP + "}")
        with pytest.raises(ConfigError, match="nested too deeply"):
            c.reload(None)
        assert sorted(t.tenant_id for t in c.status().tenants) == ["a", "r"]
        assert c.status().supervisor.internal_errors == 0
