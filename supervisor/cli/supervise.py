"""``twt supervise``: run the supervisor in the foreground until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import sys

from shared.config import load_config
from shared.log import configure_logging

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "supervise",
        help="run a supervisor in the foreground",
        description="Run a supervisor: one worker process per tenant instance, ZeroMQ routing, "
        "crash and hang recovery. Stops gracefully on SIGTERM/SIGINT. Settings: defaults < "
        "[supervisor] table of --config < TWT_* environment < these flags.",
    )
    p.add_argument("--config", help="TOML file with a [supervisor] table and [[tenant]] tables")
    p.add_argument("--run-dir", help="directory for sockets, admin.cap and the lock (0700)")
    p.add_argument("--backend", choices=["auto", "stub", "cuda"], help="compute backend (default auto)")
    p.add_argument("--start-method", choices=["spawn", "forkserver"], help="how workers are started (default spawn)")
    p.add_argument("--log-format", choices=["text", "json"], help="log lines as text or one JSON object each")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--pool-size", type=int, help="idle warm workers kept ready (default 2)")
    p.add_argument("--metrics-addr", help="serve Prometheus /metrics on HOST:PORT (e.g. 127.0.0.1:9464)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(
            args.config,
            overrides={
                "run_dir": args.run_dir,
                "backend": args.backend,
                "start_method": args.start_method,
                "log_format": args.log_format,
                "log_level": args.log_level,
                "pool_size": args.pool_size,
                "metrics_addr": args.metrics_addr,
            },
        )
    except TypeError as exc:  # a wrongly typed value in the config file: the user's input
        raise ValueError(str(exc)) from None
    configure_logging(config.log_format, config.log_level.upper())  # type: ignore[arg-type]
    from supervisor.supervisor import Supervisor

    metrics = None
    if config.metrics_addr:
        from supervisor.prometheus import PrometheusMetrics  # type: ignore[import-not-found,unused-ignore]

        metrics = PrometheusMetrics(config.metrics_addr, tenant_names=config.metrics_tenant_names)
    sup = Supervisor(config, metrics=metrics)
    code = sup.run()
    sys.stderr.flush()
    return code
