"""One ext_proc ``Process`` stream, spoken as the Gateway API Inference Extension's EPP.

The contract (GIE ``docs/proposals/004-endpoint-picker-protocol``, v1.0.0; Envoy's
``envoy.service.ext_proc.v3``):

* Request headers, then the body in ``FULL_DUPLEX_STREAMED`` mode: the headers are answered
  only once the whole body is in, because the destination depends on it. Then, in this
  order: the headers response (``x-gateway-destination-endpoint`` set, route cache cleared,
  ``envoy.lb`` dynamic metadata with the same value) and one body response that streams the
  original bytes back (``end_of_stream``). In ``BUFFERED`` mode the headers are acknowledged
  at once and the destination rides on the body response instead.
* Several endpoints (``EppConfig.fallbacks``) are written ``primary,fallback,...``.
* The subset hint: ``metadata_context.filter_metadata["envoy.lb.subset_hint"]
  ["x-gateway-destination-endpoint-subset"]`` (a list, or a comma-separated string)
  restricts the choice; empty or with nothing eligible -> 503.
* The response: the serving endpoint from ``metadata_context["envoy.lb"]
  ["x-gateway-destination-endpoint-served"]`` (or a response header of that name) gets the
  request's accounting; response body chunks are echoed back unchanged in full-duplex mode
  (their first one settles the prefill estimate of a stream); the request is released when
  the response ends or the stream closes (Envoy closes it when the HTTP request is done).
* Refusals are immediate responses with OpenAI-shaped JSON bodies: 400 unparseable body,
  404 unknown model, 413 oversized body, 429 shedding, 503 nothing eligible.

Response bodies through the EPP cost one gRPC round trip per streamed chunk (the first one
on the time to first token) and ~0.2 ms of the EPP's CPU per chunk, so the recommended
gateway configuration does not send them (``response_body_mode: NONE``; docs/epp.md). The
first byte then comes from a second ext_proc filter in ``observability_mode`` (the
*first-byte observer*): Envoy sends it the response headers and body without waiting for
any answer; the routing reply left the request's ticket id in the ``kvmesh.ticket`` dynamic
metadata, which the observer forwards, so its first body chunk settles that ticket's
prefill, and the EPP then closes the observer stream (no more chunks). Without the observer
a stream's prefill work stays counted until the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvmesh.routing.dispatcher import Refusal, Ticket

from .config import (
    DEST_HEADER,
    LB_NAMESPACE,
    PICKED_HEADER,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    TICKET_NAMESPACE,
)
from .scoring import EndpointPicker

log = logging.getLogger(__name__)

_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased name -> value (Envoy sends ``raw_value`` bytes; older ones ``value``)."""
    out = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway allows, or None when it set no hint."""
    ns = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in ns or SUBSET_KEY not in ns[SUBSET_NAMESPACE].fields:
        return None
    value = ns[SUBSET_NAMESPACE].fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value.strip() for v in value.list_value.values if v.string_value.strip()]
    if kind == "string_value":
        return [p.strip() for p in value.string_value.split(",") if p.strip()]
    return []


def served_endpoint(request: pb.ProcessingRequest, headers: Mapping[str, str]) -> str | None:
    ns = request.metadata_context.filter_metadata
    if LB_NAMESPACE in ns and SERVED_KEY in ns[LB_NAMESPACE].fields:
        value = str(ns[LB_NAMESPACE].fields[SERVED_KEY].string_value).strip()
        if value:
            return value
    got = headers.get(SERVED_KEY)
    return str(got) if got else None


def route_mutation(
    endpoints: Sequence[str], content_length: int | None = None, ticket_id: str | None = None
) -> tuple[pb.CommonResponse, struct_pb2.Struct]:
    """The header mutation and dynamic metadata that send a request to ``endpoints`` (and
    set its ``content-length``, as the reference EPP does, when the body is sent on); the
    ticket id goes into the ``kvmesh.ticket`` metadata, for the first-byte observer."""
    value = ",".join(endpoints)
    options = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DEST_HEADER, raw_value=value.encode()), append_action=_OVERWRITE
        )
    ]
    if content_length is not None:
        options.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="content-length", raw_value=str(content_length).encode()),
                append_action=_OVERWRITE,
            )
        )
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=options), clear_route_cache=True)
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DEST_HEADER: value}})
    if ticket_id is not None:
        meta.update({TICKET_NAMESPACE: {"id": ticket_id}})
    return common, meta


def ticket_id(request: pb.ProcessingRequest) -> str | None:
    """The ticket id the routing reply left in the dynamic metadata (the observer's messages)."""
    ns = request.metadata_context.filter_metadata
    if TICKET_NAMESPACE in ns and "id" in ns[TICKET_NAMESPACE].fields:
        return str(ns[TICKET_NAMESPACE].fields["id"].string_value) or None
    return None


def immediate(refusal: Refusal, retry_after_s: int = 1) -> pb.ProcessingResponse:
    headers = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")
        )
    ]
    if refusal.status in (429, 503):
        headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="retry-after", raw_value=str(retry_after_s).encode())
            )
        )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=refusal.status),  # type: ignore[arg-type,unused-ignore]
            headers=pb.HeaderMutation(set_headers=headers),
            body=refusal.body,
            details=f"kvmesh_epp_{refusal.status}",
        )
    )


def _streamed(body: bytes, end: bool) -> pb.CommonResponse:
    return pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end))
    )


class StreamTimeout(Exception):
    """A stream missed its deadline (``request_timeout_s`` / ``stream_idle_timeout_s``)."""


async def _deadlined(
    requests: AsyncIterator[pb.ProcessingRequest], handler: StreamHandler
) -> AsyncIterator[pb.ProcessingRequest]:
    """``requests`` with deadlines: until the request is routed, one for the whole request
    (headers and body: dripping chunks does not extend it); then one per message."""
    cfg = handler.picker.config
    loop = asyncio.get_running_loop()
    request_deadline = loop.time() + cfg.request_timeout_s
    it = aiter(requests)
    while True:
        routed = handler.ticket is not None or handler.finished
        when = loop.time() + cfg.stream_idle_timeout_s if routed else request_deadline
        try:
            async with asyncio.timeout_at(when):
                request = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            what = (
                f"idle for {cfg.stream_idle_timeout_s} s"
                if routed
                else (f"request not complete within {cfg.request_timeout_s} s")
            )
            raise StreamTimeout(f"kvmesh epp closed the stream: {what}") from None
        yield request


class StreamHandler:
    """The state of one ext_proc stream (one HTTP request); see the module docstring."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.request_mode = _FULL_DUPLEX
        self.response_mode = _FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.ticket: Ticket | None = None
        self.ticket_id: str | None = None
        self.observing = False  # a first-byte observer's stream (observability mode)
        self.finished = False  # an immediate response was sent: nothing more to say

    async def run(
        self, requests: AsyncIterator[pb.ProcessingRequest]
    ) -> AsyncIterator[pb.ProcessingResponse]:
        metrics = self.picker.metrics
        metrics.streams.inc()
        try:
            async for request in _deadlined(requests, self):
                for response in await self.handle(request):
                    yield response
                if self.finished:
                    return
        finally:
            metrics.streams.dec()
            if self.ticket is not None and not self.observing:
                self.picker.tickets.pop(self.ticket_id or "", None)
                self.ticket.finished()

    async def handle(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = request.WhichOneof("request")
        if request.observability_mode:
            return self._observe(request, kind)
        if request.HasField("protocol_config"):
            self.request_mode = request.protocol_config.request_body_mode or _FULL_DUPLEX
            self.response_mode = request.protocol_config.response_body_mode or _FULL_DUPLEX
        if kind == "request_headers":
            return await self._request_headers(request)
        if kind == "request_body":
            return await self._request_body(request)
        if kind == "request_trailers":
            out = [] if self.ticket is not None else await self._route(with_body=True, end=False)
            if self.finished:  # refused: the immediate response is the last word
                return out
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return self._response_headers(request)
        if kind == "response_body":
            return self._response_body(request)
        if kind == "response_trailers":
            self._done()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        log.debug("ignoring ext_proc message %s", kind)
        return []

    # -- request path --------------------------------------------------------------------------------

    async def _request_headers(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = header_map(request.request_headers)
        self.subset = subset_hint(request)
        if request.request_headers.end_of_stream:  # no body (GET /v1/models): route by load
            return await self._route(with_body=False, end=True)
        if self.request_mode == _FULL_DUPLEX:
            return []  # answered with the destination once the body is in
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    async def _request_body(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        chunk = request.request_body
        self.body += chunk.body
        limit = self.picker.config.max_body_bytes
        if len(self.body) > limit:
            refusal = self.picker.refuse(413, f"request body is larger than {limit} bytes")
            return self._immediate(refusal)
        if not chunk.end_of_stream:
            return []
        return await self._route(with_body=True, end=True)

    async def _route(self, *, with_body: bool, end: bool) -> list[pb.ProcessingResponse]:
        t0 = time.perf_counter()
        raw = bytes(self.body)
        got = await self.picker.decide(
            raw, path=self.headers.get(":path", ""), headers=self.headers, subset=self.subset
        )
        if isinstance(got, Refusal):
            return self._immediate(got)
        self.ticket = got
        self.ticket_id = self.picker.register(got)
        length = None
        if got.body is not None:  # the picker changed the body (a client's kv_transfer_params dropped)
            # and its length: Envoy leaves content-length to the processor that mutates a body.
            raw, length = got.body, len(got.body)
        common, meta = route_mutation(got.ranked, length, self.ticket_id)
        if not with_body:
            out = [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta
                )
            ]
        elif self.request_mode == _FULL_DUPLEX:
            out = [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta
                ),
                pb.ProcessingResponse(request_body=pb.BodyResponse(response=_streamed(raw, end))),
            ]
        else:  # BUFFERED: the headers were acknowledged; the mutation comes with the body
            if got.body is not None:
                common.body_mutation.CopyFrom(pb.BodyMutation(body=raw))
            out = [
                pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=meta)
            ]
        self.picker.metrics.decision_latency.observe(time.perf_counter() - t0)
        got.sent()
        self.body = bytearray()  # sent on; not kept for the response's lifetime
        return out

    def _immediate(self, refusal: Refusal) -> list[pb.ProcessingResponse]:
        self.finished = True
        return [immediate(refusal, self.picker.routing.retry_after_s)]

    # -- response path -------------------------------------------------------------------------------

    def _response_headers(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        headers = header_map(request.response_headers)
        if self.ticket is not None:
            try:
                status = int(headers.get(":status", "0"))
            except ValueError:
                status = 0
            self.picker.served(self.ticket, served_endpoint(request, headers), status)
        if request.response_headers.end_of_stream:
            self._done()
        if self.ticket is None or not self.picker.routing.replica_header:
            # Off by default: naming the endpoint tells any client where others' prefixes are cached.
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        # Which endpoint the EPP picked, for clients and logs (the gateway says which served).
        option = base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=PICKED_HEADER, raw_value=self.ticket.ranked[0].encode()),
            append_action=_OVERWRITE,
        )
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[option]))
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))]

    def _response_body(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        chunk = request.response_body
        if self.ticket is not None:
            self.ticket.first_byte()
        if chunk.end_of_stream:
            self._done()
        if self.response_mode == _FULL_DUPLEX:
            return [
                pb.ProcessingResponse(
                    response_body=pb.BodyResponse(response=_streamed(chunk.body, chunk.end_of_stream))
                )
            ]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    def _done(self) -> None:
        if self.ticket is not None:
            self.picker.tickets.pop(self.ticket_id or "", None)
            self.ticket.finished()

    # -- the first-byte observer ---------------------------------------------------------------------

    def _observe(self, request: pb.ProcessingRequest, kind: str | None) -> list[pb.ProcessingResponse]:
        """A message of a filter in observability mode: never answered. Its first body chunk
        is the first byte of the request whose ticket the metadata names; then the stream is
        closed, so Envoy sends it nothing more."""
        self.observing = True
        if self.ticket is None:
            tid = ticket_id(request)
            self.ticket = self.picker.tickets.get(tid) if tid is not None else None
            if self.ticket is None:
                self.finished = True  # nothing to observe (an unrouted or ended request)
                return []
        if kind == "response_body" and self.ticket.stream:
            self.ticket.first_byte()
            self.finished = True
        return []


def describe_response(response: pb.ProcessingResponse) -> dict[str, Any]:
    """A short readable form of a response (logs and test failure messages)."""
    return {"kind": response.WhichOneof("response"), "meta": dict(response.dynamic_metadata.fields)}
