"""``twt bench density``'s parking workload, the parts that decide what it measures: the Zipf
stream and the parked state a restart starts from (the bench itself is a program, run by hand)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from shared.spec import TenantSpec
from supervisor.store.state import StateStore
from supervisor.tools.bench.density_parking import (IDLE_S, MAX_ACTIVE, RUN_WASM_SHARE, STREAM_REQUESTS, ZIPF_S,
                                                    cpu_sample, park_all, zipf_stream)
from tests.helpers import timeouts
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def state_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="twt-density-", dir=short_temp_dir())
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_zipf_stream_is_seeded_and_skewed_as_zipf_1_1() -> None:
    stream = zipf_stream(1000, 20_000, 1.1, seed=3)
    assert stream == zipf_stream(1000, 20_000, 1.1, seed=3) and stream != zipf_stream(1000, 20_000, 1.1, seed=4)
    assert all(0 <= i < 1000 for i in stream)
    counts = [n for _, n in Counter(stream).most_common()]
    # P(rank 1) / P(rank 2) = 2**1.1 = 2.14; P(1) / P(10) = 10**1.1 = 12.6
    assert 1.7 < counts[0] / counts[1] < 2.7
    assert 9 < counts[0] / counts[9] < 17
    # ranks are shuffled over the tenants: the popular ones are not the first registered
    assert [i for i, _ in Counter(stream).most_common(3)] != [0, 1, 2]


def _activating(requests: int, seed: int, tenants: int = 10_008) -> Counter[str]:
    """The stream's counted activating requests per op, as ``measure_stream`` draws them (its ops
    from ``seed + 1``), on a least-recently-used set of ``MAX_ACTIVE - 1`` active tenants (what the
    early park keeps room for); a tenant's first run_wasm ever compiles and is not counted."""
    import random
    from collections import OrderedDict

    rng = random.Random(seed + 1)
    active: OrderedDict[int, None] = OrderedDict()
    ran: set[int] = set()
    counted: Counter[str] = Counter()
    for index in zipf_stream(tenants, requests, ZIPF_S, seed):
        op = "run_wasm" if rng.random() < RUN_WASM_SHARE else "ping"
        woke = index not in active
        if woke and len(active) >= MAX_ACTIVE - 1:
            active.popitem(last=False)
        active[index] = None
        active.move_to_end(index)
        if op == "run_wasm" and index not in ran:
            ran.add(index)
            continue
        if woke:
            counted[op] += 1
    return counted


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_full_streams_p99s_rest_on_at_least_five_activating_requests_each(seed: int) -> None:
    """Each op's activation overhead p99 is read from its activating requests: the worst 1 % of
    them must be >= 5 requests, not the second-worst of ~140 (the run_wasm p99 of a 2,000-request
    stream, where most run_wasm activations are a tenant's first run, which compiles)."""
    counted = _activating(STREAM_REQUESTS, seed)
    assert counted["run_wasm"] // 100 >= 5 and counted["ping"] // 100 >= 5, counted


def test_park_all_stores_the_tenants_as_parked_with_one_instance_and_an_idle_timeout(state_dir: str) -> None:
    store = StateStore.open(state_dir)
    store.register_many([(TenantSpec(f"t{i}", instances=0), 1, "runtime") for i in range(3)] +
                        [(TenantSpec("other", instances=0), 4, "runtime")])
    store.close()
    park_all(state_dir, ["t0", "t1", "t2"])
    store = StateStore.open(state_dir)
    try:
        tenants = {t.tenant_id: t for t in store.tenants()}
        for name in ("t0", "t1", "t2"):
            t = tenants[name]
            assert t.parked and t.spec.instances == 1 and t.spec.idle_timeout_s == IDLE_S and t.generation == 1
        assert not tenants["other"].parked and tenants["other"].spec.instances == 0
        assert tenants["other"].generation == 4
    finally:
        store.close()


def test_the_warm_share_counts_every_worker_an_activation_got() -> None:
    from supervisor.tools.bench.density import warm_share

    assert warm_share({"activation_workers": {"warm": 97, "warming": 2, "starting": 0, "spawned": 1}}) == 97.0
    assert warm_share({"activation_workers": {}}) == 100.0  # no activation: none went without


#: imported by the fork server before it serves: it burns a known 0.05 s of CPU there, so that the
#: first sample finds the fork server's own CPU above a clock tick however fast Python starts
_PRELOAD = """
import time
t = time.process_time()
while time.process_time() - t < 0.05:
    pass
"""

_FORKING_PARENT = """
import multiprocessing, sys, time
from multiprocessing import forkserver

def burn() -> None:
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass

def nothing() -> None:
    pass

if __name__ == "__main__":
    multiprocessing.set_forkserver_preload(["fork_server_preload"])
    ctx = multiprocessing.get_context("forkserver")
    # ensure_running returns before the fork server has even started: the first child's start
    # is what waits for it to be up and its preload done
    first = ctx.Process(target=nothing)
    first.start()
    first.join()
    print("ready", flush=True)
    sys.stdin.readline()
    p = ctx.Process(target=burn)
    p.start()
    p.join()
    print("done", flush=True)
    sys.stdin.readline()
"""


def test_the_streams_cpu_counts_the_fork_servers_workers_after_they_exit(tmp_path: Any) -> None:
    """The stream's CPU per activation reads the supervisor, its fork server and the workers the
    fork server forked: a worker that burned 0.3 s and exited between two samples is counted (the
    fork server reaped it), the supervisor's own CPU is not taken for a worker's."""
    script = tmp_path / "forking_parent.py"
    script.write_text(_FORKING_PARENT)
    (tmp_path / "fork_server_preload.py").write_text(_PRELOAD)
    with subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, cwd=str(tmp_path)) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "ready"
            before = cpu_sample(proc.pid)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "done"
            after = cpu_sample(proc.pid)
            proc.stdin.write("end\n")
            proc.stdin.flush()
            proc.wait(timeouts.scaled(30))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert after["workers"] - before["workers"] >= 0.25
    assert after["fork_server"] >= before["fork_server"] >= 0.04
    assert after["supervisor"] - before["supervisor"] < 0.25
