"""Relay a local vLLM replica's KV events to any number of subscribers, on loopback.

vLLM's ZMQ publisher binds only wildcard and ipc endpoints and *connects* to any other, so
at a replica's ``tcp://127.0.0.1:PORT`` nobody is bound and subscribers that connect (the
kvmesh router, vllm-router) would never receive an event. :class:`EventForwarder` binds
there and republishes (see :attr:`kvmesh.harness.replicas.Replica.events_out`).
"""

from __future__ import annotations

import threading
from types import TracebackType


class EventForwarder:
    """Receives a vLLM replica's KV events on ``tcp://127.0.0.1:in_port`` (bound here; vLLM's
    publisher connects to a non-wildcard endpoint) and republishes them, loopback only, on
    ``tcp://127.0.0.1:out_port`` for any number of subscribers that connect.

    A ZMQ XSUB/XPUB proxy on a daemon thread: subscriptions flow upstream, events downstream,
    without the GIL (``zmq.proxy_steerable`` runs in libzmq).
    """

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._xsub = self._ctx.socket(zmq.XSUB)
        self._xpub = self._ctx.socket(zmq.XPUB)
        self._ctl = self._ctx.socket(zmq.PAIR)
        self._ctl_addr = f"inproc://kvmesh-events-ctl-{id(self)}"
        self._ctl.bind(self._ctl_addr)
        self.in_port = self._xsub.bind_to_random_port("tcp://127.0.0.1")
        self.out_port = self._xpub.bind_to_random_port("tcp://127.0.0.1")
        self._thread = threading.Thread(target=self._run, name="kv-event-forwarder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        ctl = self._ctx.socket(zmq.PAIR)
        ctl.connect(self._ctl_addr)
        try:
            zmq.proxy_steerable(self._xsub, self._xpub, None, ctl)
        except zmq.ZMQError:
            pass  # the context went away: stopping
        finally:
            ctl.close(linger=0)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._ctl.send(b"TERMINATE")
            self._thread.join(5)
        for sock in (self._ctl, self._xsub, self._xpub):
            sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> EventForwarder:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
