"""``twt supervise``: run the supervisor in the foreground until SIGTERM/SIGINT (SIGHUP reloads the config).

Start-up order matters to an operator: the run directory is locked *before*
anything is bound, so a second supervisor on the same run dir reports the
lock ("another supervisor (pid N) is running on ...") rather than a busy
metrics port. Python warnings (the resource tracker's among them) are routed
into the structured log instead of landing in it as raw text.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from contextlib import ExitStack
from typing import TextIO

from shared.config import SupervisorConfig, load_config, unknown_env_vars
from shared.log import configure_logging, get_logger, log_event
from supervisor.observe.metrics import Metrics
from supervisor.store.rundir import RunDir

__all__ = ["add_parser", "run"]

_log = get_logger("supervisor")
_DEFAULTS = SupervisorConfig.__dataclass_fields__


def _default(name: str) -> str:
    return f"default: ${'TWT_' + name.upper()}, else the config file, else {_DEFAULTS[name].default}"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "supervise",
        help="run a supervisor in the foreground",
        description="Run a supervisor: one worker process per tenant instance, ZeroMQ routing, "
        "crash and hang recovery. Stops gracefully on SIGTERM/SIGINT: new requests are refused (Draining) while "
        "those in flight finish (drain_timeout_s; a second signal cuts it short), then the workers stop. "
        "SIGHUP re-reads --config (as twt reload). "
        "Tenants come back from the state directory after a restart. Settings: defaults < "
        "[supervisor] table of --config < TWT_* environment < these flags.",
    )
    p.add_argument("--config", metavar="FILE",
                   help="TOML file with a [supervisor] table and [[tenant]] tables (default: none)")
    p.add_argument("--run-dir", help="directory for sockets, admin.cap and the lock, 0700 "
                   "(default: $TWT_RUN_DIR, else the config file, else $XDG_RUNTIME_DIR/twt or /tmp/twt-<uid>)")
    p.add_argument("--state-dir", help="directory of the durable state database (default: <run dir>/state)")
    p.add_argument("--backend", choices=["auto", "stub", "cuda"], help=f"compute backend ({_default('backend')})")
    p.add_argument("--start-method", choices=["spawn", "forkserver"],
                   help=f"how workers are started ({_default('start_method')})")
    p.add_argument("--log-format", choices=["text", "json"],
                   help=f"log lines as text or one JSON object each ({_default('log_format')})")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help=f"least severe level logged ({_default('log_level')})")
    p.add_argument("--pool-size", type=int, help=f"idle warm workers kept ready ({_default('pool_size')})")
    p.add_argument("--metrics-addr", metavar="HOST:PORT",
                   help="serve Prometheus /metrics, /healthz and /readyz on HOST:PORT, e.g. 127.0.0.1:9464 "
                   "(default: $TWT_METRICS_ADDR, else the config file, else off)")
    p.add_argument("--listen", action="append", metavar="tcp://HOST:PORT",
                   help="also serve clients over TCP with CURVE on this endpoint (repeatable; port 0: any free port; "
                   "default: $TWT_LISTEN, else the config file, else none)")
    p.add_argument("--server-key-file", metavar="FILE",
                   help="the CURVE key pair as a certificate file (default: made once, kept in the state database)")
    p.add_argument("--client-keys-dir", metavar="DIR",
                   help="allow only the client public keys (*.key certificates) in this directory over TCP "
                   "(default: any client key)")
    p.add_argument("--allow-remote-admin", action="store_true", default=None,
                   help="accept admin ops over TCP (refused by default)")
    p.set_defaults(func=run)


def _log_warnings(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """``warnings.showwarning`` replacement: a warning becomes a ``python.warning`` log event."""
    log_event(_log, logging.WARNING, "python.warning", category=category.__name__, message=str(message),
              where=f"{filename}:{lineno}")


def _quiet_resource_tracker() -> None:
    """Keep the resource tracker's "leaked shared_memory" warning out of the log stream.

    The tracker is a separate interpreter writing to our stderr; it would print
    raw text into a JSON log after a SIGKILL. It inherits our ``-W`` options
    when it starts, so it is started here with that one warning ignored. What
    it reports is not lost: the next supervisor on the run dir logs the dead
    one's segments as ``supervisor.stale_segments_removed``.
    """
    from multiprocessing import resource_tracker

    option = "ignore::UserWarning:multiprocessing.resource_tracker"
    if option not in sys.warnoptions:
        sys.warnoptions.append(option)
    resource_tracker.ensure_running()


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(
            args.config,
            overrides={
                "run_dir": args.run_dir,
                "state_dir": args.state_dir,
                "backend": args.backend,
                "start_method": args.start_method,
                "log_format": args.log_format,
                "log_level": args.log_level,
                "pool_size": args.pool_size,
                "metrics_addr": args.metrics_addr,
                "listen": args.listen,
                "server_key_file": args.server_key_file,
                "client_keys_dir": args.client_keys_dir,
                "allow_remote_admin": args.allow_remote_admin,
            },
        )
    except TypeError as exc:  # a wrongly typed value in the config file: the user's input
        raise ValueError(str(exc)) from None
    configure_logging(config.log_format, config.log_level.upper())  # type: ignore[arg-type]
    warnings.showwarning = _log_warnings
    for name in unknown_env_vars():
        log_event(_log, logging.WARNING, "config.unknown_env", variable=name,
                  hint="not a setting; see docs/OPERATIONS.md#configuration")
    _quiet_resource_tracker()
    from supervisor.observe.sd_notify import SystemdNotifier
    from supervisor.supervisor import Supervisor

    # The lock first: a second supervisor on this run dir must report *that*, not a busy port.
    rundir = RunDir(config.run_dir, config.client_group)
    rundir.acquire()
    with ExitStack() as undo:
        undo.callback(rundir.release)
        metrics: Metrics | None = None
        if config.metrics_addr:
            from supervisor.observe.prometheus import PrometheusMetrics  # type: ignore[import-not-found,unused-ignore]

            metrics = PrometheusMetrics.from_config(config)
            undo.callback(metrics.close)
        # systemd Type=notify: READY=1 once supervisor.json is written, WATCHDOG=1 from the loop, STOPPING=1
        notifier = SystemdNotifier.from_environ()  # and the variables leave the environment workers inherit
        undo.callback(notifier.close)
        sup = Supervisor(config, metrics=metrics, rundir=rundir, notifier=notifier)  # acquire(): a no-op now
        undo.pop_all()
    code: int = sup.run()
    sys.stderr.flush()
    return code
