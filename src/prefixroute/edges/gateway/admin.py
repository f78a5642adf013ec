"""The admin API: the fleet's replicas, drain and undrain, configuration reload.

``GET /admin/backends``
    every replica with its state (``up``, ``draining``: no new requests, some in flight;
    ``drained``: none left; ``leaving``: removed by its source, finishing its requests),
    where it came from (``config``, ``file:PATH``, ``dns:NAME``), health, breaker and load.
``POST /admin/backends/{name}/drain[?wait_s=S]``
    no new requests for the replica; those in flight finish. With ``wait_s`` the answer
    waits up to S seconds for them (``"drained": true`` once none is left).
``POST /admin/backends/{name}/undrain``
    it takes requests again.
``POST /admin/reload``
    re-read the configuration file (as ``SIGHUP`` does); 400 with the reason if it is
    invalid, and the running one stays.

Only ``admin`` tenants may call them (401 without a valid key, 403 for another tenant).
Answers are JSON; errors are OpenAI-style error objects.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from prefixroute.core.errors import PrefixRouteError
from prefixroute.edges.gateway.errors import GatewayError
from prefixroute.edges.gateway.fleet import UnknownBackend

MAX_DRAIN_WAIT_S = 600.0


class AdminAPI:
    """The admin endpoints of one gateway (``gateway``: its :class:`Gateway`)."""

    def __init__(self, gateway: Any):
        self.gateway = gateway

    def _authorize(self, request: Request) -> None:
        tenant = self.gateway.tenants.authenticate(request.headers.get("authorization"))
        if not tenant.admin:
            raise GatewayError(403, "the admin API is for admin tenants only",
                               code="permission_denied")

    async def backends(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except GatewayError as error:
            return error.response()
        return JSONResponse({"object": "list", "data": self.gateway.fleet.describe()})

    async def drain(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            self._authorize(request)
            wait_s = _wait_s(request)
            fleet = self.gateway.fleet
            try:
                entry = await fleet.drain(name)
            except UnknownBackend:
                raise _unknown(name) from None
            drained = await fleet.wait_drained(name, wait_s) if wait_s else \
                entry.backend.in_flight == 0
        except GatewayError as error:
            return error.response()
        return JSONResponse({"name": name, "state": fleet.state_of(entry),
                             "in_flight": entry.backend.in_flight, "drained": drained})

    async def undrain(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            self._authorize(request)
            try:
                entry = await self.gateway.fleet.undrain(name)
            except UnknownBackend:
                raise _unknown(name) from None
        except GatewayError as error:
            return error.response()
        return JSONResponse({"name": name, "state": self.gateway.fleet.state_of(entry)})

    async def reload(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except GatewayError as error:
            return error.response()
        try:
            result = await self.gateway.reload()
        except PrefixRouteError as exc:
            return GatewayError(400, f"configuration not reloaded: {exc}",
                                code="invalid_config").response()
        return JSONResponse(result)


def _wait_s(request: Request) -> float:
    text = request.query_params.get("wait_s")
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise GatewayError(400, f"wait_s must be a number of seconds, got {text!r}",
                           param="wait_s", code="invalid_value") from None
    if not 0 <= value <= MAX_DRAIN_WAIT_S:
        raise GatewayError(400, f"wait_s must be between 0 and {MAX_DRAIN_WAIT_S:g}",
                           param="wait_s", code="invalid_value")
    return value


def _unknown(name: str) -> GatewayError:
    return GatewayError(404, f"no replica named {name!r}; GET /admin/backends lists them",
                        code="backend_not_found")
