"""The hop's floor: an ext_proc server that does none of the EPP's work.

``epp_bench.py`` runs it behind the same Envoy bootstrap as ``prefixroute epp`` (front
``envoy+floor``), so each run shows how much of what Envoy + EPP add is the hop itself
(Envoy's ext_proc filter and access log, the messages, the hand-offs between two processes)
and how much is the EPP's own work (authentication, admission, salting, hashing, the
policy, the bookkeeping).

It answers every request's body message as the EPP answers on the bootstrap's fast route,
on the EPP's own transport (``edges/epp/http2.py``): the same body back, the next replica
round robin in the ``envoy.lb`` metadata, a tag in the ``prefixroute`` namespace (so Envoy
reads the answer's usage and logs the request, as it does for the EPP), and the stream
closed in the same write. A headers message (a request off the fast route) is let through.
Access log batches are read and dropped. It is a measuring stick, not a router: it checks
nothing and books nothing.

Run: ``python benchmarks/epp_floor.py --port PORT --endpoints IP:PORT,IP:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import socket

import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import struct_pb2

from prefixroute.edges.epp.http2 import GrpcServer, Stream
from prefixroute.edges.epp.protocol import (ACCESS_LOG_METHOD, DESTINATION, EXCHANGE_KEY,
                                            LB_NAMESPACE, METADATA_NAMESPACE, PROCESS_METHOD)
from prefixroute.edges.gateway.server import GC_THRESHOLDS

_LET_THROUGH = ext.ProcessingResponse(
    request_headers=ext.HeadersResponse(response=ext.CommonResponse())).SerializeToString()


class FloorExchange:
    """One ext_proc stream: the body message answered and the stream closed at once."""

    def __init__(self, stream: Stream, endpoints: itertools.cycle[str],
                 tags: itertools.count[int]):
        self.stream, self.endpoints, self.tags = stream, endpoints, tags

    def message(self, data: bytes) -> None:
        message = ext.ProcessingRequest.FromString(data)
        if message.WhichOneof("request") != "request_body":
            self.stream.send_and_close([_LET_THROUGH])
            return
        metadata = struct_pb2.Struct()
        metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = \
            next(self.endpoints)
        metadata.fields[METADATA_NAMESPACE].struct_value.fields[EXCHANGE_KEY].string_value = \
            f"floor-{next(self.tags):x}"
        answer = ext.ProcessingResponse(
            request_body=ext.BodyResponse(response=ext.CommonResponse(
                body_mutation=ext.BodyMutation(body=message.request_body.body))),
            dynamic_metadata=metadata)
        self.stream.send_and_close([answer.SerializeToString()])

    def end(self) -> None:
        self.stream.close()

    def reset(self) -> None:
        pass


class DroppedLog:
    """Envoy's access log stream: batches read and dropped."""

    def __init__(self, stream: Stream):
        self.stream = stream

    def message(self, data: bytes) -> None:
        pass

    def end(self) -> None:
        self.stream.close()

    def reset(self) -> None:
        pass


async def serve(port: int, endpoints: list[str]) -> None:
    cycle, tags = itertools.cycle(endpoints), itertools.count()

    def opener(stream: Stream, path: str, headers=()) -> FloorExchange | DroppedLog | None:
        if path == PROCESS_METHOD:
            return FloorExchange(stream, cycle, tags)
        if path == ACCESS_LOG_METHOD:
            return DroppedLog(stream)
        return None

    sock = socket.create_server(("127.0.0.1", port), backlog=128)
    sock.setblocking(False)
    server = GrpcServer(opener, max_message=64 << 20)
    await server.start(sock)
    await asyncio.Event().wait()  # until the benchmark stops it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoints", required=True, help="IP:PORT,IP:PORT (round robin)")
    args = parser.parse_args()
    gc.freeze()  # as the EPP does
    gc.set_threshold(*GC_THRESHOLDS)
    uvloop.run(serve(args.port, args.endpoints.split(",")))


if __name__ == "__main__":
    main()
