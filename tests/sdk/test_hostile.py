"""Hostile C tenants built with ``twt build``: what libc lets a guest try, and how the host contains it.

Each guest is a real C program against wasi-libc, compiled once per session.
The host must turn every attempt into a typed result (a trap code, a
timeout, an exit code, a failed libc call inside the guest), keep every
counter where it started, and serve the next run from the same worker.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.errors import KernelTimeout, WasmTrap
from tests.helpers.sdk_build import SdkBuilder
from tests.helpers.timeouts import scaled
from tests.helpers.wasm_env import Env, compiled_once, tenant_env
from worker.backends.stub import StubBackend
from worker.wasm import abi

pytestmark = pytest.mark.timeout(300)  # the first build of a session compiles wasi-libc

MiB = 1 << 20
MAX_MEMORY = 2 * MiB

HOSTILE = r"""
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <unistd.h>

#include "tensorwasm.h"

/* a store far outside linear memory */
TWT_EXPORT(wild_store) int32_t wild_store(int32_t value) {
    volatile int32_t *p = (volatile int32_t *)(uintptr_t)0xFFFFFFF0u;
    *p = value;
    return 0;
}

/* fopen of host paths: -errno of the last attempt, or 1 if any opened (printed either way) */
TWT_EXPORT(open_host_files) int32_t open_host_files(void) {
    const char *paths[] = {"/etc/passwd", "/proc/self/environ", "./secret", "/", "../../etc/shadow"};
    int result = 0;
    for (unsigned i = 0; i < sizeof paths / sizeof *paths; i++) {
        errno = 0;
        FILE *f = fopen(paths[i], "r");
        printf("fopen %s: %s\n", paths[i], f ? "OPENED" : strerror(errno));
        if (f) { fclose(f); return 1; }
        result = -errno;
    }
    DIR *d = opendir("/");
    if (d) { closedir(d); return 2; }
    FILE *w = fopen("/tmp/twt-guest-was-here", "w");
    if (w) { fclose(w); return 3; }
    printf("env: %s argv0 ok\n", getenv("PATH") ? "PATH set" : "empty");
    return result;
}

/* printf without end */
TWT_EXPORT(flood) int32_t flood(int32_t lines) {
    for (int32_t i = 0; i < lines; i++) printf("flood line %d with some padding to make it longer\n", i);
    fprintf(stderr, "flood done\n");
    return lines;
}

/* one enormous line */
TWT_EXPORT(long_line) int32_t long_line(int32_t n) {
    for (int32_t i = 0; i < n; i++) putchar('x');
    putchar('\n');
    return n;
}

TWT_EXPORT(leave) int32_t leave(int32_t code) {
    printf("leaving with %d\n", code);
    exit(code);
}

TWT_EXPORT(spin) int32_t spin(void) {
    volatile uint64_t i = 0;
    for (;;) i++;
    return 0;
}

/* malloc 64 KiB blocks until malloc fails; the total obtained, touching every block. The blocks
 * escape through a volatile pointer: clang may otherwise drop an unused malloc and assume success. */
static void *volatile sink;
TWT_EXPORT(hog) int64_t hog(void) {
    int64_t total = 0;
    for (;;) {
        char *p = malloc(64 * 1024);
        if (p == NULL) break;
        memset(p, 0xAB, 64 * 1024);
        sink = p;
        total += 64 * 1024;
    }
    printf("malloc gave %lld bytes before failing\n", (long long)total);
    return total;
}

TWT_EXPORT(nap) int32_t nap(void) {
    int rc = usleep(5 * 1000 * 1000);
    return rc == 0 ? 0 : -errno;
}
"""

#: the runs' deadlines where a deadline is not what a test is about: hang guards, scaled (a 20,000-line
#: printf flood passed a fixed 30 s on a host loaded far past its cores)
RUN_S = scaled(30)
SHORT_RUN_S = scaled(10)


@pytest.fixture
def guest(sdk: SdkBuilder) -> bytes:
    return sdk.source("hostile.c", HOSTILE)


@pytest.fixture
def env(guest: bytes) -> Iterator[Env]:
    """A fresh host per test; the guest compiled by the process's first one (each test checks its
    runs, on the same machine code)."""
    with tenant_env("hostile", StubBackend(), max_memory=MAX_MEMORY, memory_quota=64 * MiB,
                    wasm_timeout_s=RUN_S) as e, compiled_once(e, guest):
        yield e


def still_serves(env: Env, guest: bytes) -> None:
    reply = env.host.run(guest, "leave", [0], fuel=10**9, timeout_s=SHORT_RUN_S)
    assert reply["exit_code"] == 0
    # its one line, unless a flood just before emptied the worker's token bucket (then it counts as dropped)
    assert reply["logs"] == ["leaving with 0"] or (reply["logs"], reply["logs_dropped"]) == ([], 1)
    assert env.counters() == (0, 0)


def test_a_wild_pointer_store_is_a_bounds_trap(env: Env, guest: bytes) -> None:
    with pytest.raises(WasmTrap) as trap:
        env.host.run(guest, "wild_store", [7], fuel=10**9, timeout_s=SHORT_RUN_S)
    assert trap.value.trap_code == "memory_out_of_bounds"
    still_serves(env, guest)


def test_host_files_cannot_be_opened(env: Env, guest: bytes) -> None:
    reply = env.host.run(guest, "open_host_files", [], fuel=10**9, timeout_s=SHORT_RUN_S)
    (result,) = reply["results"]
    assert result < 0, reply["logs"]  # no fopen, opendir or create succeeded
    assert not any("OPENED" in line for line in reply["logs"])
    assert len([line for line in reply["logs"] if line.startswith("fopen ")]) == 5
    assert "env: empty argv0 ok" in reply["logs"]
    still_serves(env, guest)


def test_a_printf_flood_is_rate_limited(env: Env, guest: bytes) -> None:
    lines = 20_000
    reply = env.host.run(guest, "flood", [lines], fuel=10**10, timeout_s=RUN_S)
    assert reply["results"] == [lines]
    assert len(reply["logs"]) == abi.MAX_LOG_LINES_IN_REPLY
    assert reply["logs"][0] == "flood line 0 with some padding to make it longer"
    # at most the per-run limit got through; every other line (and the stderr one) was counted as dropped
    kept = lines + 1 - reply["logs_dropped"]
    assert 0 < kept <= abi.MAX_LOG_LINES_PER_RUN
    assert env.host.limiter.dropped > 0 or kept == abi.MAX_LOG_LINES_PER_RUN
    still_serves(env, guest)


def test_a_long_line_is_truncated(env: Env, guest: bytes) -> None:
    reply = env.host.run(guest, "long_line", [100_000], fuel=10**10, timeout_s=RUN_S)
    (line,) = reply["logs"]
    assert line == "x" * abi.MAX_LOG_BYTES + " [truncated]"


def test_proc_exit_ends_the_run_with_its_code(env: Env, guest: bytes) -> None:
    reply = env.host.run(guest, "leave", [3], fuel=10**9, timeout_s=SHORT_RUN_S)
    assert reply["exit_code"] == 3 and reply["results"] == []
    assert reply["logs"] == ["leaving with 3"]  # exit() flushed stdio first
    still_serves(env, guest)


def test_an_infinite_loop_is_stopped_by_the_deadline(env: Env, guest: bytes) -> None:
    env.host.compile(guest)  # compiled ahead (compiling counts against the deadline too; under load it may not fit)
    with pytest.raises(KernelTimeout) as timeout:
        env.host.run(guest, "spin", [], fuel=10**15, timeout_s=0.5)
    assert timeout.value.timeout_s == 0.5
    still_serves(env, guest)


def test_malloc_until_failure_stays_within_the_memory_limit(env: Env, guest: bytes) -> None:
    reply = env.host.run(guest, "hog", [], fuel=10**11, timeout_s=RUN_S)
    (total,) = reply["results"]
    assert 0 < total < MAX_MEMORY
    assert reply["memory_bytes"] <= MAX_MEMORY
    assert MAX_MEMORY - reply["memory_bytes"] < 4 * 65536  # it did grow to (nearly) the cap
    still_serves(env, guest)


def test_sleeping_is_refused_not_blocking(env: Env, guest: bytes) -> None:
    reply = env.host.run(guest, "nap", [], fuel=10**9, timeout_s=RUN_S)
    assert reply["results"] == [-58]  # ENOTSUP from poll_oneoff, at once: the 5 s sleep never happens
