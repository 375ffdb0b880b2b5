"""The SDK tests' one builder: every example and hostile guest is compiled once per run, whichever
xdist worker needs it first (tests/helpers/sdk_build.py)."""

from __future__ import annotations

import pytest

from tests.helpers.sdk_build import SdkBuilder, shared_build_dir


@pytest.fixture(scope="session")
def sdk(tmp_path_factory: pytest.TempPathFactory) -> SdkBuilder:
    return SdkBuilder(tmp_path_factory.mktemp("sdk-build"), shared_build_dir(tmp_path_factory))
