"""The kvmesh router in a child process of its own (benchmarks, the demo): sharing the
benchmark client's interpreter would put the client's work on the router's latency."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import Service, get_json

if TYPE_CHECKING:
    from kvmesh.router.config import RouterConfig

_MAIN = """
import sys
from kvmesh.router.app import RouterService
from kvmesh.router.config import RouterConfig
from kvmesh.router.server import run_forever
run_forever(RouterService(RouterConfig.model_validate_json(sys.argv[1])))
"""


class RouterProcess(Service):
    """``RouterService`` + ``run_forever`` in a child process; ready when ``/health``
    counts every replica of its config healthy."""

    name = "kvmesh router"

    def __init__(self, config: RouterConfig, log_path: str | None = None) -> None:
        """``config``: its port 0 is replaced by a free one."""
        self.port = int(config.port) or free_port()
        self.replicas = len(config.replicas)
        cfg_json = config.merged(port=self.port).model_dump_json()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        super().__init__([sys.executable, "-c", _MAIN, cfg_json], env, log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        status, body = get_json(self.url + "/health", 1.0)
        return status == 200 and isinstance(body, dict) and body.get("healthy_replicas") == self.replicas
