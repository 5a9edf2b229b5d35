"""The on-disk format of the ``segments`` layout (see :mod:`kvmesh.tiers.segments`).

Everything 4 KiB aligned; slot ``i`` of the segment file starts at ``i * ru_size``::

    slot   = slot header (4 KiB: magic, slot seq, ru_size, level, xxh64) + records
    record = prefix (magic, level, slot seq, record length, xxh64) + serde header + payload

A record carries its slot's sequence number, so a scan never mistakes leftovers of an
older incarnation of the slot (one not punched, or not yet) for live records.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from collections.abc import Callable

import xxhash

from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.core.serde import ChunkFormat
from kvmesh.errors import CorruptChunkError

ALIGN = 4096
SLOT_MAGIC = b"KVSEG001"
REC_MAGIC = b"KVSR"
_SLOT = struct.Struct("<8sQQI")  # magic, seq, ru_size, level
_REC = struct.Struct("<4sIQQ")  # magic, level, slot seq, record length (unpadded)
_SUM = struct.Struct("<Q")
REC_PREFIX = _REC.size + _SUM.size
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x1, 0x2
SYNC_FILE_RANGE_WRITE = 0x2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_header(seq: int, ru: int, level: int) -> bytes:
    head = _SLOT.pack(SLOT_MAGIC, seq, ru, level)
    head += _SUM.pack(xxhash.xxh3_64_intdigest(head))
    return head + bytes(ALIGN - len(head))


def parse_slot_header(buf: bytes, ru: int) -> tuple[int, int] | None:
    """``(seq, level)`` of a valid slot header written under this ``ru`` size, else None."""
    if len(buf) < _SLOT.size + _SUM.size or buf[:8] != SLOT_MAGIC:
        return None
    if _SUM.unpack_from(buf, _SLOT.size)[0] != xxhash.xxh3_64_intdigest(buf[: _SLOT.size]):
        return None
    _, seq, slot_ru, level = _SLOT.unpack_from(buf)
    return (int(seq), int(level)) if slot_ru == ru else None


def record_prefix(level: int, seq: int, length: int) -> bytes:
    prefix = _REC.pack(REC_MAGIC, level, seq, length)
    return prefix + _SUM.pack(xxhash.xxh3_64_intdigest(prefix))


def parse_prefix(buf: bytes, seq: int | None) -> int:
    """The record length a prefix declares, or -1 if it is not a record (of ``seq``)."""
    if len(buf) < REC_PREFIX or buf[:4] != REC_MAGIC:
        return -1
    if _SUM.unpack_from(buf, _REC.size)[0] != xxhash.xxh3_64_intdigest(buf[: _REC.size]):
        return -1
    _, _, rseq, length = _REC.unpack_from(buf)
    return int(length) if seq is None or rseq == seq else -1


def scan_slot(
    fd: int, slot: int, ru: int, fmt: ChunkFormat = serde.PLAIN
) -> tuple[int, int, list[tuple[str, int, int]], int] | None:
    """Read slot ``slot``: ``(seq, level, [(key, file offset, record length)], used bytes)``,
    records up to the first whose header does not verify in ``fmt``; None for a free or
    foreign slot."""
    got = parse_slot_header(os.pread(fd, _SLOT.size + _SUM.size, slot * ru), ru)
    if got is None:
        return None
    seq, level = got
    records: list[tuple[str, int, int]] = []
    used = ALIGN
    while used + REC_PREFIX <= ru:
        off = slot * ru + used
        buf = os.pread(fd, REC_PREFIX + 4096, off)
        length = parse_prefix(buf, seq)
        if length < 0 or used + pad(length) > ru:
            break
        try:
            hlen = fmt.header_length(buf[REC_PREFIX:])
            if len(buf) < REC_PREFIX + hlen:
                buf = os.pread(fd, REC_PREFIX + hlen, off)
            header = fmt.decode_header(buf[REC_PREFIX:])
        except CorruptChunkError:
            break
        records.append((header.key, off, length))
        used += pad(length)
    return seq, level, records, used


def read_record(
    fd: int,
    off: int,
    length: int,
    seq: int,
    key: ChunkKey | str,
    alloc: Callable[[serde.ChunkHeader], memoryview],
    fmt: ChunkFormat = serde.PLAIN,
) -> tuple[serde.ChunkHeader, memoryview]:
    """The verified header and the stored payload (in ``alloc(header)``) of the record of
    ``key`` at ``off``; :class:`CorruptChunkError` unless it is that record of slot ``seq``
    (the payload's tag is the caller's ``fmt.decode_payload``)."""
    first = os.pread(fd, min(length, REC_PREFIX + 4096), off)
    if parse_prefix(first, seq) != length:
        raise CorruptChunkError(f"record of {key} at {off} does not carry slot seq {seq}")
    hlen = fmt.header_length(first[REC_PREFIX:])
    if REC_PREFIX + hlen > length:
        raise CorruptChunkError(f"record of {key} at {off} is shorter than its header")
    hbytes = first[REC_PREFIX : REC_PREFIX + hlen]
    if len(hbytes) < hlen:
        hbytes = os.pread(fd, hlen, off + REC_PREFIX)
    header = fmt.decode_header(hbytes, key)
    if REC_PREFIX + hlen + header.payload_len != length:
        raise CorruptChunkError(f"record of {key} at {off} is {length} bytes, its header says otherwise")
    body = alloc(header)
    if os.preadv(fd, [body], off + REC_PREFIX + hlen) != len(body):
        raise CorruptChunkError(f"record of {key} truncated")
    return header, body


def punch(fd: int, off: int, length: int) -> bool:
    """Deallocate ``[off, off + length)`` (a discard where the filesystem passes it down)."""
    flags = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    return int(_libc.fallocate(fd, flags, ctypes.c_int64(off), ctypes.c_int64(length))) == 0


def start_writeback(fd: int, off: int, length: int) -> bool:
    """Start writing ``[off, off + length)`` to the device now, without waiting for it
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, as RocksDB's ``bytes_per_sync``).

    Left to the kernel, written pages stay dirty until the ``fdatasync`` that makes them
    durable: the device idles while they are copied into the page cache, then takes them all
    at once, and many dirty pages run into the kernel's throttling, which stalls a later
    write. Started as each piece is written, the device writes while the next is copied in,
    and the ``fdatasync`` waits for what is left. Not a durability step: ``False`` where the
    call is missing or refused (the ``fdatasync`` still does it all).
    """
    if _sync_file_range is None:
        return False
    return int(_sync_file_range(fd, ctypes.c_int64(off), ctypes.c_int64(length), SYNC_FILE_RANGE_WRITE)) == 0


_sync_file_range = getattr(_libc, "sync_file_range", None)  # Linux only
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
