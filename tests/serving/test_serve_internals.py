"""Each private Ray Serve API of serving/serve_internals.py is still there and shaped as warpspec uses
it, on the installed Ray: an upgrade that moves or changes one fails here, by name."""

import inspect

import ray
from ray.serve.request_router import RequestRouter

from warpspec.serving import serve_internals
from warpspec.serving.serve_internals import ChoiceHookRouter, gRPCRequest, serve_start

CHECKED = f"(checked against ray {serve_internals.SERVE_CHECKED}, installed {ray.__version__})"


def test_the_default_router_is_a_public_request_router_with_the_choice_hook_warpspec_overrides():
    assert issubclass(ChoiceHookRouter, RequestRouter), CHECKED
    base = ChoiceHookRouter.__mro__[1]
    assert base.__name__ == "PowerOfTwoChoicesRequestRouter" and inspect.iscoroutinefunction(base.choose_replicas)
    hook = getattr(RequestRouter, "_choose_replica_for_request", None)
    assert hook is not None and inspect.iscoroutinefunction(hook), f"_choose_replica_for_request is gone {CHECKED}"
    parameters = inspect.signature(hook).parameters
    assert list(parameters) == ["self", "pending_request", "is_retry"], f"its signature changed {CHECKED}"
    assert parameters["is_retry"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_grpc_proxys_wrapper_carries_the_users_message():
    assert gRPCRequest(user_request_proto="message").user_request_proto == "message", CHECKED


def test_serve_start_takes_the_options_of_a_config_file():
    parameters = inspect.signature(serve_start).parameters
    assert {"http_options", "grpc_options"} <= set(parameters), CHECKED
