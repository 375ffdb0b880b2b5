"""``twt top`` at many tenants: every status page read by cursor as table rows, each tenant once,
the same cells ``twt status`` shows; unhealthy and busy tenants first; cut to the screen."""

from __future__ import annotations

import threading

import pytest

from shared.errors import InvalidArgument
from shared.records import STATUS_PAGE_MAX
from shared.spec import TenantSpec
from supervisor.cli import main
from supervisor.cli.status import tenant_row
from supervisor.cli.top import fetch_rows, render_rows, row_cells
from tests.helpers.cluster import supervisor

pytestmark = pytest.mark.timeout(300)

#: more than one page of rows (the status page holds at most STATUS_PAGE_MAX)
MANY = STATUS_PAGE_MAX + 76


def test_top_reads_every_page_of_rows_at_many_tenants(capsys: pytest.CaptureFixture[str]) -> None:
    with supervisor([{"name": "acme", "gpu_memory_bytes_cap": "1MiB"}]) as sup:
        c = sup.client
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                with sup.connect(timeout_s=120.0) as own:
                    for i in range(k, MANY, 4):
                        own.register(None, TenantSpec(f"t{i:05d}", instances=0))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not errors, errors
        cap = c.tenant_capability(None, "acme")
        c.alloc(cap, 4096)
        status = fetch_rows(c)
        ids = [r.tenant_id for r in status.rows]
        assert len(ids) == len(set(ids)) == MANY + 1 and status.next is None  # every page, each tenant once
        assert status.summary is not None and status.summary.tenants == MANY + 1
        # the row shows what twt status shows for the same tenant
        row = next(r for r in status.rows if r.tenant_id == "acme")
        record = c.status(limit=1).tenants[0]
        assert record.tenant_id == "acme"
        assert row_cells(row)[:9] == tenant_row(record)[:9]
        assert row.gpu_bytes_in_use == 4096 and row.pids == record.pids
        stopped = next(r for r in status.rows if r.tenant_id == "t00000")
        assert (stopped.state, stopped.ready, stopped.wanted, stopped.pids) == ("stopped", 0, 0, ())
        # cut to the screen: the rest counted; the one tenant not stopped-or-running comes first
        c.register(None, TenantSpec("zz-failing", instances=1, restart="never"))
        c.inject_fault(None, "zz-failing", "crash")
        status = fetch_rows(c)
        text = render_rows(status, 5)
        lines = text.splitlines()
        assert f"... {MANY + 2 - 5} more" in text
        first_row = lines[lines.index(next(ln for ln in lines if ln.startswith("---"))) + 1]
        assert first_row.split()[0] in ("zz-failing", "acme"), first_row
        # the command: piped, every row
        assert main(["top", "--iterations", "1", "--run-dir", sup.run_dir]) in (0, 1)
        out, _ = capsys.readouterr()
        assert out.count("\nt0") == MANY and "more (twt status --all)" not in out
        assert main(["top", "--iterations", "1", "--rows", "3", "--run-dir", sup.run_dir]) in (0, 1)
        out, _ = capsys.readouterr()
        assert f"... {MANY + 2 - 3} more" in out
        with pytest.raises(InvalidArgument, match="view"):
            c.call("status", c.reader, {"view": "everything"})
