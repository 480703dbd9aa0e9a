"""Prefix-aware routing (serving/prefix_router.py): the keys it derives from a request, and, through
Serve's real gRPC proxy, that requests opening like an earlier one reach the replica whose prefix
cache holds that opening."""

from __future__ import annotations

import pickle
import random
from types import SimpleNamespace

import grpc
import pytest
from conftest import ENGINE_ARGS

from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc
from warpspec.serving.prefix_router import prefix_keys


def _request(ids: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                              params=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def _as_routed(*args) -> SimpleNamespace:
    """What the router reads of a pending request: its arguments."""
    return SimpleNamespace(args=list(args))


def test_keys_name_whole_16_token_blocks_chained_over_the_ones_before():
    from warpspec.serving.serve_internals import gRPCRequest

    a, b = list(range(3, 40)), list(range(3, 35)) + [99, 98, 97, 96, 95]  # agree on their first 32 tokens
    keys_a = prefix_keys(_as_routed(_request(a)))
    # Through Serve's gRPC proxy the message arrives pickled in its wrapper: the same keys.
    assert prefix_keys(_as_routed(pickle.dumps(gRPCRequest(user_request_proto=_request(a))))) == keys_a
    keys_b = prefix_keys(_as_routed(_request(b)))
    assert len(keys_a) == len(keys_b) == 2  # 37 tokens: 2 whole blocks, the rest names nothing
    assert keys_a == keys_b
    c = [7] + a[1:]  # differs in the first block: every key differs, since each chains the ones before
    assert not set(prefix_keys(_as_routed(_request(c)))) & set(keys_a)
    assert prefix_keys(_as_routed(_request(list(range(3, 18))))) == []  # under one block
    text = pb.GenerateRequest(prompt="x" * 130)
    assert len(prefix_keys(_as_routed(text))) == 2  # text: 64-character pieces
    assert prefix_keys(_as_routed(b"not a request", {"prompt": "dict"})) == []  # HTTP: power of two choices


@pytest.mark.slow
def test_requests_sharing_an_opening_reach_the_replica_that_caches_it(serving_stack):
    """2 replicas; 4 openings of 3 blocks, each sent 4 times (each time with its own question) in a
    shuffled order: after an opening's first request, every later one finds its 48 tokens cached.
    (Power of two choices sends each later request to the other replica half of the time.)"""
    from ray import serve

    from warpspec.serving.app import build_app

    app = "routing"
    serve.run(build_app({"model": str(serving_stack.model_path), "model_name": "tiny", **ENGINE_ARGS,
                         "min_replicas": 2, "max_replicas": 2}), name=app, route_prefix=f"/{app}")
    try:
        rng = random.Random(0)
        openings = [[rng.randrange(3, 200) for _ in range(48)] for _ in range(4)]
        order = [i for i in range(4) for _ in range(4)]
        rng.shuffle(order)
        seen, cached = set(), []
        with grpc.insecure_channel(serving_stack.grpc_target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for i in order:
                question = [rng.randrange(3, 200) for _ in range(5)]
                reply = stub.Generate(_request(openings[i] + question), timeout=60, metadata=[("application", app)])
                if i in seen:
                    cached.append(reply.usage.cached_tokens)
                seen.add(i)
        assert cached and all(n >= 48 for n in cached), cached
    finally:
        serve.delete(app)
