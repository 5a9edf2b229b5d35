"""The KV-event relay between a local vLLM replica and its subscribers (real ZMQ sockets)."""

from __future__ import annotations

import contextlib
import time

import zmq

from kvmesh.harness.events import EventForwarder


def test_event_forwarder_republishes_on_loopback() -> None:
    with EventForwarder() as fwd:
        ctx = zmq.Context()
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        try:
            pub.connect(f"tcp://127.0.0.1:{fwd.in_port}")  # as vLLM's publisher does
            sub.connect(f"tcp://127.0.0.1:{fwd.out_port}")
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 200)
            deadline = time.monotonic() + 10
            got = None
            while got is None and time.monotonic() < deadline:  # until the subscription is through
                pub.send_multipart([b"kv", b"\0" * 8, b"payload"])
                with contextlib.suppress(zmq.Again):
                    got = sub.recv_multipart()
            assert got == [b"kv", b"\0" * 8, b"payload"]
        finally:
            pub.close(0)
            sub.close(0)
            ctx.term()
