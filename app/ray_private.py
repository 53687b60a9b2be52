"""Every use of Ray's private APIs, in one place, each checked against RAY_VERSION
(tests/unit/test_ray_private.py fails when the installed Ray differs: re-check each then).

Each is here because no public API gives the same: say which in its docstring.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
RAY_VERSION = "2.60.0"
UNKNOWN_HOST = "<unknown>"


async def serve_http_host() -> str:
    """The host Serve's HTTP proxies listen on, as the running Serve controller has it.

    Serve keeps the http_options it started with (later deploys cannot change them), so this is
    the one source of truth; no public API reads it. If it cannot be read: UNKNOWN_HOST, which
    the API-key rule treats as public (fail closed).
    """
    try:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        options = await controller.get_http_config.remote()
        return str(options.host)
    except Exception as e:  # noqa: BLE001 - any failure means "unknown", handled as public
        log.warning("could not read Serve's HTTP host (%s); requiring an API key", e)
        return UNKNOWN_HOST


def dashboard_url() -> str | None:
    """host:port of the connected cluster's dashboard (the Serve REST API lives there); the
    public `ray.init(...).dashboard_url` is only returned to the process that connected."""
    import ray

    return ray._private.worker.get_dashboard_url() or None
