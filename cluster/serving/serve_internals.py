"""The private Ray Serve APIs warpspec uses, in one place, each with why no public API serves.

Checked against ray[serve] 2.60.0 (SERVE_CHECKED). tests/serving/test_serve_internals.py checks each
one on the installed Ray and fails, naming it, when an upgrade moves or changes it.

- PowerOfTwoChoicesRequestRouter (ray.serve._private.request_router.pow_2_router): Serve's default
  router, which the prefix router falls back to. ray.serve.request_router exports the RequestRouter
  base and its mixins, not this router.
- RequestRouter._choose_replica_for_request: where Serve settles on a request's replica. The public
  hook, on_request_routed, is called only when RAY_SERVE_ENABLE_STRICT_MAX_ONGOING_REQUESTS is set,
  so ChoiceHookRouter takes the choice here and hands it to on_replica_chosen.
- gRPCRequest (ray.serve._private.common): the wrapper Serve's gRPC proxy pickles a request in; the
  prefix router reads the user_request_proto of what it unpickles.
- serve_start (ray.serve._private.api) and its client's deploy_apps: deploy a Serve config file's
  applications as `serve deploy` does, without the dashboard's REST API (tests/k8s deploy the
  committed config this way).
"""

from __future__ import annotations

from ray.serve._private.api import serve_start
from ray.serve._private.common import gRPCRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

SERVE_CHECKED = "2.60.0"

__all__ = ["SERVE_CHECKED", "ChoiceHookRouter", "gRPCRequest", "serve_start"]


class ChoiceHookRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's power-of-two-choices router that tells on_replica_chosen which replica each request got."""

    def on_replica_chosen(self, pending_request: PendingRequest, replica: RunningReplica) -> None:
        """Called with every request's replica, once Serve has chosen it."""

    async def _choose_replica_for_request(self, pending_request: PendingRequest, *,
                                          is_retry: bool = False) -> RunningReplica:
        replica = await super()._choose_replica_for_request(pending_request, is_retry=is_retry)
        self.on_replica_chosen(pending_request, replica)
        return replica
