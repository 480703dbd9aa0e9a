"""A greedy GenerateStream in a thread of its own, as a client that watches it end: the tokens it
got, its final status, and when it ended."""

from __future__ import annotations

import threading
import time

import grpc

from warpspec.protos.warpspec.v1 import generation_pb2 as pb


class Stream(threading.Thread):
    def __init__(self, stub, max_tokens: int, prompt: list[int], metadata: list[tuple[str, str]] | None = None,
                 timeout_s: float = 180):
        super().__init__(daemon=True)
        self.stub, self.metadata, self.timeout_s = stub, metadata, timeout_s
        self.request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                          params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True))
        self.started = threading.Event()  # set at the first message, or at the end
        self.token_ids: list[int] = []
        self.code: grpc.StatusCode | None = None  # None while it runs
        self.details, self.ended_at = "", None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def run(self) -> None:
        try:
            for reply in self.stub.GenerateStream(self.request, timeout=self.timeout_s, metadata=self.metadata):
                self.token_ids += reply.token_ids
                self.started.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details()
        self.started.set()
        self.ended_at = time.monotonic()
