"""A trap in a debug build (``twt build -O debug``) names the C source line, through the DWARF the
build keeps; a release build (no name section) names an exported function by its export name, any
other by its index."""

from __future__ import annotations

import pytest

from shared.errors import WasmTrap
from tests.helpers.sdk_build import SdkBuilder
from tests.helpers.wasm_env import tenant_env
from worker.backends.stub import StubBackend

pytestmark = pytest.mark.timeout(300)  # the first build of a session compiles wasi-libc

SOURCE = """#include "tensorwasm.h"
__attribute__((noinline)) static int crash(volatile int *p, int i) {
    if (i > 2) __builtin_trap();
    return p[i];
}
TWT_EXPORT(run) int32_t run(int32_t i) {
    volatile int a[4] = {1, 2, 3, 4};
    twt_log_str("run"); /* an import: function indices count imports first */
    return crash(a, i);
}
"""


def test_a_debug_build_traps_with_file_and_line(sdk: SdkBuilder) -> None:
    module = sdk.source("trapline.c", SOURCE, optimize="debug")
    with tenant_env("sdk", StubBackend()) as env:
        assert env.host.run(module, "run", [1], fuel=10**7, timeout_s=10)["results"] == [2]
        with pytest.raises(WasmTrap) as exc:
            env.host.run(module, "run", [7], fuel=10**7, timeout_s=10)
    where = exc.value.location
    assert where.startswith("crash+0x") and "(trapline.c:3:" in where, where
    assert "run+0x" in where and "(trapline.c:9:" in where, where


def test_a_release_build_traps_with_function_offsets(sdk: SdkBuilder) -> None:
    module = sdk.source("trapline.c", SOURCE)
    with tenant_env("sdk", StubBackend()) as env, pytest.raises(WasmTrap) as exc:
        env.host.run(module, "run", [7], fuel=10**7, timeout_s=10)
    frames = exc.value.location.split(" <- ")
    assert frames[0].startswith("func[") and frames[1].startswith("run+0x"), frames  # crash is static
    assert ".c:" not in exc.value.location
