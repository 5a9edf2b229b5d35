"""schemathesis against the controller's own OpenAPI document on a running router that
manages a real engine's admin API, and against that engine API's document: positive and
negative (schema-violating) bodies for every operation. Zero 500s; every rejection of a
body is a 4xx whose ``error.field`` names it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from kvmesh import CacheConfig, CacheEngine, KVLayout  # noqa: E402
from kvmesh.admin.server import AdminServer  # noqa: E402
from kvmesh.router import RouterConfig  # noqa: E402
from kvmesh.router.config import ControllerConfig  # noqa: E402
from kvmesh.router.server import Router  # noqa: E402
from kvmesh.router.testing import write_test_tokenizer  # noqa: E402

TOKEN = "schemathesis-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
_state: dict[str, Any] = {}


@pytest.fixture(scope="module")
def controller_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("st")
    layout = KVLayout(1, 1, 8, torch.float32)
    cfg = {
        "chunk_size": 16,
        "max_local_cpu_size": 0.001,
        "local_disk": str(tmp / "disk"),
        "max_local_disk_size": 0,
    }
    engine = CacheEngine(CacheConfig.from_dict(cfg), layout=layout, model_id="m")
    admin = AdminServer(engine, token=TOKEN).start()
    ctl = ControllerConfig(admins=(f"{admin.url},name=e",), token=TOKEN, call_timeout_s=2.0)
    tok = write_test_tokenizer(Path(tmp) / "tok")
    router = Router(RouterConfig(model=str(tok), port=0, controller=ctl)).start()
    _state["router"] = router
    try:
        yield {
            "controller": schemathesis.openapi.from_url(router.url + "/kvmesh/v1/openapi.json", headers=AUTH),
            "engine": schemathesis.openapi.from_url(
                admin.url + "/kvmesh/admin/v1/openapi.json", headers=AUTH
            ),
        }
    finally:
        router.stop()
        admin.stop()
        engine.close(timeout=10)


def _prune(router: Router) -> None:
    """Random ``register`` bodies add engines at random URLs: keep the fan-out to the real one."""

    def prune() -> None:
        eps = router.service.controller.endpoints
        for name in [n for n, ep in eps.items() if not ep.static]:
            del eps[name]

    router.call(prune)


def _check(router: Router, case: Any) -> None:
    resp = case.call(headers=AUTH, timeout=30)
    try:
        case.validate_response(resp, checks=[not_a_server_error])
        assert resp.status_code < 500, resp.text
        if resp.status_code in (400, 411, 413, 422):
            err = resp.json()["error"]
            assert err.get("field"), f"{case.operation.method} {case.operation.path}: {err}"
    finally:
        _prune(router)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("api", ["controller", "engine"])
def test_admin_apis_have_no_500_and_name_the_field(
    controller_schema: Any, api: str, mode: GenerationMode
) -> None:
    # Driven by hand (not schemathesis' pytest plugin, which does not load under this pytest).
    router: Router = _state["router"]
    ops = [r.ok() for r in controller_schema[api].get_all_operations()]
    assert len(ops) >= 11
    for op in ops:

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case: Any) -> None:
            _check(router, case)

        try:
            run()
        except Unsatisfiable:
            # A GET without a body has nothing to negate.
            assert mode is GenerationMode.NEGATIVE and op.method.upper() == "GET", op.path
