"""The wire's framing: msgpack packing, the worker and control headers, buffer handles.

The part of the protocol a worker needs to serve (docs/PROTOCOL.md): it packs and checks its
headers with these and nothing else. :mod:`shared.protocol` re-exports every name here and
adds the op table, the typed ops and the client's headers. Those build some seventy dataclasses
at import (with the records they name, ~35 ms of CPU: a quarter of what a spawned worker spent
before it served), so a worker, which never reads them, imports this module alone
(tests/worker/test_start_imports.py holds it to that).

Decoding uses a fresh unpacker per message with explicit ``max_*_len`` limits and
``strict_map_key``; anything malformed raises :class:`ProtocolError` and never anything else.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Final

import msgpack

from shared.checks import is_int
from shared.errors import ProtocolError

__all__ = [
    "CONTROL_KINDS",
    "MAX_BUFFERS_PER_INSTANCE",
    "MAX_HEADER_BYTES",
    "MAX_WORKER_REPLY_BYTES",
    "MAX_WORKER_REPLY_ITEMS",
    "decode_control",
    "decode_worker_reply",
    "decode_worker_request",
    "encode_control",
    "encode_worker_reply",
    "encode_worker_request",
    "format_handle",
    "handle_incarnation",
    "handle_instance",
    "handle_seq",
    "make_handle",
    "parse_handle_text",
]

MAX_HEADER_BYTES: Final = 64 * 1024
#: Limits on decoding a *reply*: each is at least what the producer may send, so a reply
#: the system itself produced always decodes (requests keep the small limits above).
#: a worker's buffer table holds at most this many buffers (its ``buffers`` reply lists them)
MAX_BUFFERS_PER_INSTANCE: Final = 65_536
#: a worker's reply header, as the supervisor decodes it (one ``buffers`` list: ~1.3 MB)
MAX_WORKER_REPLY_BYTES: Final = 4 << 20
MAX_WORKER_REPLY_ITEMS: Final = MAX_BUFFERS_PER_INSTANCE + 1024
#: control-channel message kinds (supervisor <-> worker)
CONTROL_KINDS: Final = frozenset({"hello", "hb", "stop", "fault", "fault_ack"})


# ------------------------------------------------------------------ packing
#
# msgpack's Packer keeps a buffer between calls and is not thread-safe; the supervisor's
# loop, the client's callers and a worker's executor and control threads all pack. One
# packer per thread keeps the speed of a reused packer without sharing it.

_local = threading.local()


def _packb(obj: object) -> bytes:
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    data: bytes = packer.pack(obj)
    return data


def _unpack(data: bytes, max_len: int, max_items: int = 4096) -> object:
    if len(data) > max_len:
        raise ProtocolError(f"header of {len(data)} bytes exceeds the {max_len}-byte limit")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_len,
            max_bin_len=max_len,
            max_array_len=max_items,
            max_map_len=max(1024, max_items),
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        # ExtraData, FormatError, StackError, OutOfData, UnicodeDecodeError ...
        raise ProtocolError(f"malformed msgpack header: {type(exc).__name__}") from None


def encode_worker_request(rid: int, op: str, args: Mapping[str, object]) -> bytes:
    return _packb([rid, op, args])


def decode_worker_request(data: bytes) -> tuple[int, str, dict[str, object]]:
    obj = _unpack(data, 1 << 20)
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError("worker request must be [rid, op, args]")
    rid, op, args = obj
    if not isinstance(rid, int) or not isinstance(op, str) or not isinstance(args, dict):
        raise ProtocolError("worker request fields of the wrong type")
    return rid, op, args


def encode_worker_reply(rid: int, ok: bool, payload: object) -> bytes:
    return _packb([rid, ok, payload])


def decode_worker_reply(data: bytes, max_len: int = MAX_WORKER_REPLY_BYTES,
                        max_items: int = MAX_WORKER_REPLY_ITEMS) -> tuple[int, bool, object]:
    """Workers are semi-trusted (they run tenant code): validate like any input."""
    obj = _unpack(data, max_len, max_items)
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError("worker reply must be [rid, ok, payload]")
    rid, ok, payload = obj
    if not is_int(rid) or not isinstance(ok, bool):
        raise ProtocolError("worker reply rid/ok of the wrong type")
    return rid, ok, payload


def encode_control(kind: str, args: Mapping[str, object] | None = None) -> bytes:
    return _packb([kind, args or {}])


def decode_control(data: bytes) -> tuple[str, dict[str, object]]:
    obj = _unpack(data, MAX_HEADER_BYTES)
    if not isinstance(obj, list) or len(obj) != 2:
        raise ProtocolError("control message must be [kind, args]")
    kind, args = obj
    if not isinstance(kind, str) or kind not in CONTROL_KINDS or not isinstance(args, dict):
        raise ProtocolError(f"bad control message {kind!r}")
    return kind, args


# ------------------------------------------------------------------ handles
#
# A buffer handle names a buffer in one incarnation of one worker instance, so
# the supervisor routes free/write/read to the process that holds it, and a
# handle from before a restart is refused instead of aliasing a new buffer.
#     bits 48..55 instance | bits 32..47 incarnation (mod 2**16) | bits 0..31 sequence

_INSTANCE_SHIFT = 48
_INCARNATION_SHIFT = 32


def make_handle(instance: int, incarnation: int, seq: int) -> int:
    return (instance << _INSTANCE_SHIFT) | ((incarnation & 0xFFFF) << _INCARNATION_SHIFT) | (seq & 0xFFFFFFFF)


def handle_instance(handle: int) -> int:
    return (handle >> _INSTANCE_SHIFT) & 0xFF


def handle_incarnation(handle: int) -> int:
    return (handle >> _INCARNATION_SHIFT) & 0xFFFF


def handle_seq(handle: int) -> int:
    return handle & 0xFFFFFFFF


def format_handle(handle: int) -> str:
    """A handle as people read and type it: ``INSTANCE:SEQ`` (``1:7``, the 7th buffer of instance 1).

    The incarnation is left out: among the buffers a tenant holds, instance
    and sequence number pick one; the CLI turns the text back into the handle
    by looking it up in ``buffers`` (so a buffer that is gone is named as such).
    """
    return f"{handle_instance(handle)}:{handle_seq(handle)}"


def parse_handle_text(text: str) -> tuple[int, int]:
    """``"1:7"`` -> ``(1, 7)``: (instance, sequence number). ValueError for anything else."""
    head, sep, tail = text.strip().partition(":")
    try:
        instance, seq = int(head), int(tail)
    except ValueError:
        instance = seq = -1
    if not sep or instance < 0 or seq < 0 or instance > 0xFF or seq > 0xFFFFFFFF:
        raise ValueError(f"not a buffer handle: {text!r} (INSTANCE:SEQ as twt alloc prints it, e.g. 1:7)")
    return instance, seq
