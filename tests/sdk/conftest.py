"""The SDK tests' one session-wide builder: every example and hostile guest is compiled once per session."""

from __future__ import annotations

import pytest

from tests.helpers.sdk_build import SdkBuilder


@pytest.fixture(scope="session")
def sdk(tmp_path_factory: pytest.TempPathFactory) -> SdkBuilder:
    return SdkBuilder(tmp_path_factory.mktemp("sdk-build"))
