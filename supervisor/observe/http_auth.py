"""The metrics port's bearer token (``metrics_token_file``): read from a secret file, compared in
constant time, read again when the file changes.

Only ``/metrics`` asks for it (:mod:`supervisor.observe.http_server`); the probes never do, so the
kubelet needs no secret. Prometheus sends it with ``authorization: {credentials_file: ...}``.

Threads: :meth:`BearerToken.accepts` runs on the metrics server's thread only.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
import time
from collections.abc import Callable

from shared.errors import ConfigError
from shared.log import get_logger, log_event
from supervisor.host.secret_files import key_file_mode_problem

__all__ = ["BearerToken"]

_log = get_logger("supervisor.observe.metrics")


class BearerToken:
    """The secret ``/metrics`` asks for, read from ``metrics_token_file``.

    The file holds one token (16..4096 visible ASCII characters; surrounding
    whitespace ignored) and must be a secret file: not readable by others
    (:func:`supervisor.host.secret_files.key_file_mode_problem`, the rule the
    CURVE key file follows). It is read again when it changes (a rotated
    Kubernetes Secret), at most once a second; if the new content is unusable the
    old token stays in force and the problem is logged. Compared in constant time.
    """

    MIN_CHARS = 16
    MAX_CHARS = 4096

    def __init__(self, path: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._checked = clock()
        self._stamp, self._token = self._load()

    def _load(self) -> tuple[tuple[int, int, int], bytes]:
        """(the file's identity, its token); ConfigError naming the problem."""
        where = f"metrics_token_file {self.path}"
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not hang the start
        except OSError as exc:
            raise ConfigError.listing(where, [f"cannot be read ({(exc.strerror or str(exc)).lower()})"]) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError.listing(where, ["is not a regular file"])
            problem = key_file_mode_problem(st.st_mode, st.st_uid, st.st_gid, uid=os.geteuid(), gid=os.getegid())
            if problem is not None:
                raise ConfigError.listing(where, [problem])
            raw = os.read(fd, self.MAX_CHARS + 64)
        finally:
            os.close(fd)
        token = raw.strip()
        if not self.MIN_CHARS <= len(token) <= self.MAX_CHARS or not all(0x21 <= b <= 0x7E for b in token):
            raise ConfigError.listing(where, [f"must hold one token of {self.MIN_CHARS}..{self.MAX_CHARS} visible "
                                              "ASCII characters (e.g. `openssl rand -hex 32`)"])
        return (st.st_ino, st.st_mtime_ns, st.st_size), token

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < 1.0:
            return
        self._checked = now
        try:
            try:
                st = os.stat(self.path)
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            except OSError:
                stamp = (-1, -1, -1)  # gone (a Secret being swapped): keep the token, say so once
                if stamp == self._stamp:
                    return
                self._stamp = stamp
                raise
            if stamp == self._stamp:
                return
            self._stamp = stamp  # a file that cannot be used is reported once, not every second
            self._stamp, self._token = self._load()
            log_event(_log, logging.INFO, "metrics.token_reloaded", path=self.path)
        except (OSError, ConfigError) as exc:
            log_event(_log, logging.WARNING, "metrics.token_not_reloaded", path=self.path, error=str(exc),
                      hint="the previous token stays in force")

    def accepts(self, authorization: str | None) -> bool:
        """True when the ``Authorization`` header carries this token (scheme ``Bearer``, any case)."""
        self._refresh()
        if authorization is None:
            return False
        scheme, _, given = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode("latin-1", "replace"), self._token)
