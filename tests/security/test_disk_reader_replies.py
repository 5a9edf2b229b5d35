"""The disk tier's reader process (``disk_read_process``) answers over a socket pair the
tier made, with a staging buffer both map: kvmesh's own child, yet its replies cross a
process boundary, so the tier bounds and verifies each one as if it came from outside.
Every nonsense reply here (the socket's other end is the test's, not the child's) ends the
child and the batch is read in the tier's process: exact chunks, never a payload copied on
a reply's word. The child's reads themselves: tests/unit/tiers/test_disk_read_process.py."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvmesh.core import serde
from kvmesh.transport.wire import send_msg
from tests.unit.tiers.test_disk import assert_same
from tests.unit.tiers.test_disk_read_process import open_child_tier, stored

NONSENSE = [
    "out_of_bounds", "no_header", "too_few", "not_a_list", "another_keys_header", "tampered_header",
    "wrong_length",
]  # fmt: skip


@pytest.mark.parametrize("bogus", NONSENSE)
def test_a_nonsense_reply_ends_the_child_and_reads_go_on_here(tmp_path: Path, bogus: str) -> None:
    """Fault injection: the socket's other end is the test's, not the child's. The tier
    verifies each header the child sends as if read from the file: another key's header, a
    header with one byte changed, or a length its header does not give end the child."""
    child_tier = open_child_tier(tmp_path / "d")
    try:
        chunks, reader = stored(child_tier, 2, seed=15)
        h0, h1 = (child_tier.files.read(c.key, stamp=False) for c in chunks)
        n = h0.header.raw_len
        tampered = bytearray(h0.header_bytes)
        tampered[serde.PREFIX_SIZE + 3] ^= 0x01  # inside the JSON, under the header's checksum
        ours, theirs = socket.socketpair()
        reader._sock.close()
        reader._sock = ours
        item = {
            "out_of_bounds": ["ok", h0.header_bytes, reader.staging.nbytes - 8, n, 64],
            "no_header": ["ok", None, 0, n, 64],
            "too_few": ["ok", h0.header_bytes, 0, n, 64],
            "not_a_list": 7,
            "another_keys_header": ["ok", h1.header_bytes, 0, n, 64],
            "tampered_header": ["ok", bytes(tampered), 0, n, 64],
            "wrong_length": ["ok", h0.header_bytes, 0, n - 8, 64],
        }[bogus]
        send_msg(theirs, {"items": [item] if bogus == "too_few" else [item, item]})
        got = child_tier.get([c.key for c in chunks])
        for g, c in zip(got, chunks, strict=True):
            assert_same(g, c)
        assert not reader.alive and reader.served == 0
        theirs.close()
    finally:
        child_tier.close()
