"""Throwaway object stores for tests and benchmarks, on loopback: moto's standalone S3 server
(``moto_server``: the most production-like S3 server that installs from the registries here;
MinIO and Ceph RGW do not) and a Mooncake Store master (``mooncake_master`` from the
``mooncake-transfer-engine-non-cuda`` wheel, with its HTTP metadata server)."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kvmesh.errors import ProcessError
from kvmesh.harness.ports import free_port
from kvmesh.harness.services import TlsFiles

S3_CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoServer:
    """``moto_server`` on a free loopback port; its log in ``workdir``. ``tls``: serve https
    with that certificate (:attr:`tier_url` then names its CA as ``ca_bundle``)."""

    def __init__(self, workdir: Path, tls: TlsFiles | None = None) -> None:
        self.tls = tls
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        exe = Path(sys.executable).with_name("moto_server")
        self.cmd = [str(exe) if exe.exists() else (shutil.which("moto_server") or "moto_server")]

    @property
    def endpoint(self) -> str:
        return f"{'http' if self.tls is None else 'https'}://127.0.0.1:{self.port}"

    def tier_url(self, bucket: str, prefix: str = "pfx") -> str:
        """An ``s3://`` tier URL of ``bucket`` on this server, credentials included."""
        ca = "" if self.tls is None else f"&ca_bundle={quote(str(self.tls.ca))}"
        return (
            f"s3://{bucket}/{prefix}?endpoint_url={self.endpoint}&access_key_id=testing"
            f"&secret_access_key=testing&region=us-east-1{ca}"
        )

    def start(self) -> None:
        log = open(self.workdir / f"moto-{self.port}.log", "ab")  # noqa: SIM115 - closed with the process
        env = {**os.environ, **S3_CREDS}
        tls = [] if self.tls is None else ["-c", str(self.tls.cert), "-k", str(self.tls.key)]
        self.proc = subprocess.Popen(
            [*self.cmd, "-H", "127.0.0.1", "-p", str(self.port), *tls], stdout=log, stderr=log, env=env
        )
        context = None if self.tls is None else ssl.create_default_context(cafile=str(self.tls.ca))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessError(
                    f"moto_server exited: {(self.workdir / f'moto-{self.port}.log').read_text()[-2000:]}"
                )
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1, context=context).read()
                return
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise TimeoutError("moto_server did not answer within 30 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self) -> Any:
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            verify=None if self.tls is None else str(self.tls.ca),
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )


def mooncake_master_binary() -> str:
    import mooncake

    return str(Path(mooncake.__file__).with_name("mooncake_master"))


class MooncakeMaster:
    """A ``mooncake_master`` with its HTTP metadata server, on free loopback ports."""

    def __init__(self, workdir: Path) -> None:
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return (
            f"mooncakestore://127.0.0.1:{self.rpc}/?metadata_server=http://127.0.0.1:{self.http}/metadata"
            "&global_segment_size=33554432&local_buffer_size=16777216"
        )

    def start(self) -> None:
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115 - lives as long as the process
        cmd = [mooncake_master_binary(), "-rpc_port", str(self.rpc), "-rpc_address", "127.0.0.1",
               "-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1",
               "-http_metadata_server_port", str(self.http), "-metrics_port", str(self.metrics),
               "-enable_metric_reporting=false"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.rpc), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        self.kill()
        raise ProcessError(
            f"mooncake_master did not start: {(self.workdir / 'master.log').read_text()[-1500:]}"
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
