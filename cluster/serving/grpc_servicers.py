"""The warpspec.v1.Generation servicer function Serve's gRPC proxy registers (serve_config's
GRPC_SERVICER_FUNCTIONS): the generated one's handlers, with request parsing that cannot fail.

The proxy parses each request with the handler's request_deserializer before Serve routes it. With
the generated `GenerateRequest.FromString`, bytes that are not a GenerateRequest (a string field that
is not UTF-8, a corrupt wire format) raise inside grpc, and the client gets UNKNOWN "Unexpected
DecodeError" from the proxy. Here they become a MalformedMessage that travels to the replica like any
request, and GenerationService refuses it with INVALID_ARGUMENT naming the message type.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from warpspec.protos.warpspec.v1 import generation_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]


@dataclass(frozen=True)
class MalformedMessage:
    type_name: str  # the message the bytes should have been, e.g. "GenerateRequest"
    error: str  # protobuf's reason
    request_id: str = ""  # handlers that echo a request's id read it from any request

    def describe(self) -> str:
        return f"the {self.type_name} message does not parse: {self.error}"


def _tolerant_parser(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return MalformedMessage(message_type.DESCRIPTOR.name, str(e).split(": ")[-1][:200])
    return parse


def add_GenerationServicer_to_server(servicer, server) -> None:  # noqa: N802 - the name grpc's codegen uses
    handlers = {}
    for method in SERVICE.methods:
        request_type, response_type = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=_tolerant_parser(request_type),
                                     response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
