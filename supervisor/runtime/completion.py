"""A completion: the result of a domain operation that waits on workers, delivered once.

A registration is answered once every instance of the tenant is ready, an
eviction once its workers are gone, a reset or a rolling restart once the
tenant runs again. The domain method (:class:`~supervisor.control.admin.AdminOps`,
:class:`~supervisor.control.service.ServiceOps`) returns a :class:`Completion`
and keeps it where the event that ends the wait will find it (a tenant's
``register_waiters`` or ``ready_waiters``); whoever asked says what the
outcome means with :meth:`Completion.then` - the op adapter under
:mod:`supervisor.control.ops` answers its request on the wire, an internal
caller (a restore, a reload) may ignore it. The domain never sees a client
identity or a request id.

It is a :class:`concurrent.futures.Future` stripped to what the loop needs:
no lock (loop thread only), no waiting, the outcome is a value or a
:class:`~shared.errors.TensorWasmError`, and the first outcome wins - a later
``resolve`` or ``fail`` is ignored, as a request is answered once.

Owns: nothing but its own outcome and callbacks. Loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from shared.errors import TensorWasmError

__all__ = ["Completion"]

T = TypeVar("T")


class Completion(Generic[T]):
    """One outcome, later: a value or a typed error (see the module docstring)."""

    __slots__ = ("_done", "_value", "_error", "_callbacks")

    def __init__(self) -> None:
        self._done = False
        self._value: tuple[T] | None = None  # a 1-tuple: a value of None is still a value
        self._error: TensorWasmError | None = None
        self._callbacks: list[tuple[Callable[[T], None], Callable[[TensorWasmError], None]]] = []

    @classmethod
    def resolved(cls, value: T) -> Completion[T]:
        """A completion that is done already (an eviction with no worker left to wait for)."""
        done: Completion[T] = cls()
        done.resolve(value)
        return done

    @property
    def done(self) -> bool:
        """An outcome was delivered."""
        return self._done

    def resolve(self, value: T) -> None:
        """Deliver ``value`` to every callback (ignored once an outcome was delivered)."""
        if self._done:
            return
        self._done, self._value = True, (value,)
        callbacks, self._callbacks = self._callbacks, []
        for on_ok, _ in callbacks:
            on_ok(value)

    def fail(self, exc: TensorWasmError) -> None:
        """Deliver ``exc`` to every callback (ignored once an outcome was delivered)."""
        if self._done:
            return
        self._done, self._error = True, exc
        callbacks, self._callbacks = self._callbacks, []
        for _, on_error in callbacks:
            on_error(exc)

    def then(self, on_ok: Callable[[T], None], on_error: Callable[[TensorWasmError], None]) -> None:
        """Call ``on_ok(value)`` or ``on_error(exc)`` with the outcome: now if it is done, else when it is."""
        if not self._done:
            self._callbacks.append((on_ok, on_error))
        elif self._value is not None:
            on_ok(self._value[0])
        elif self._error is not None:
            on_error(self._error)
