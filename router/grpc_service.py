"""pdserve.v1.Generation's method handlers, registered as the generated
`add_GenerationServicer_to_server` registers them but for one thing: a request whose bytes
do not parse becomes a `MalformedMessage`, which the gateway answers with INVALID_ARGUMENT,
where the generated deserializer's DecodeError made grpc answer UNKNOWN ("Unexpected
<class 'DecodeError'>"): a server error, for a client's mistake.

Serve's proxies and direct-ingress servers take the servicer functions by import path
(cluster/launch/app.py: GRPC_SERVICER_FUNCTIONS, deploy/serve.yaml); this module imports only grpc
and the generated messages, so that they load it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from protos.pdserve.v1 import generation_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]


@dataclass(frozen=True)
class MalformedMessage:
    """What arrived in place of a `message_type` that did not parse (picklable: with Serve's
    proxy ingress it travels to the gateway replica through Ray)."""

    message_type: str
    reason: str


def add_generation_servicer_to_server(servicer, server) -> None:
    handlers = {}
    for method in SERVICE.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        handler = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = handler(getattr(servicer, method.name), request_deserializer=_parser(request),
                                        response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return MalformedMessage(message_class.DESCRIPTOR.full_name, str(e))

    return parse
