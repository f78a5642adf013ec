"""The hop's floor: an ext_proc server that does none of the EPP's work.

``epp_bench.py`` runs it behind the same Envoy bootstrap as ``prefixroute epp`` (front
``envoy+floor``), so each run shows how much of what Envoy + EPP add is the hop itself
(Envoy's ext_proc filter and access log, the messages, the hand-offs between two processes)
and how much is the EPP's own work (authentication, admission, salting, hashing, the
policy, the bookkeeping).

It answers every request's body message with the EPP's own fast-route answer
(:func:`prefixroute.edges.epp.picker.fast_route_answer`), on the EPP's own transport
(``edges/epp/http2.py``): the same body back, the next replica round robin in the
``envoy.lb`` metadata (one endpoint: no fallbacks), a tag in the EPP's namespace (so Envoy
reads the answer's usage and logs the request, as it does for the EPP), and the stream
closed in the same write. Envoy's access log batches are decoded and each entry's tag read
back, as the EPP reads them. A headers message (a request off the fast route) is let
through; any other message ends the stream. It is a measuring stick, not a router: it
checks nothing and books nothing.

Run: ``python benchmarks/epp_floor.py --port PORT --endpoints IP:PORT,IP:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import uvloop
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from prefixroute.edges.epp.http2 import MAX_GRPC_MESSAGE, GrpcServer, Stream
from prefixroute.edges.epp.picker import fast_route_answer, routing_metadata
from prefixroute.edges.epp.protocol import (ACCESS_LOG_METHOD, EXCHANGE_KEY,
                                            METADATA_NAMESPACE, PROCESS_METHOD)
from prefixroute.edges.epp.server import grpc_socket
from prefixroute.edges.gateway.server import tune_gc_once_started

_LET_THROUGH = ext.ProcessingResponse(
    request_headers=ext.HeadersResponse(response=ext.CommonResponse())).SerializeToString()


class Floor:
    """The replicas round robin, and the tags answered and not yet logged."""

    def __init__(self, endpoints: list[str]):
        self.endpoints = itertools.cycle(endpoints)
        self.tags = itertools.count()
        self.unlogged: set[str] = set()

    def answer(self, body: bytes) -> bytes:
        tag = f"floor-{next(self.tags):x}"
        self.unlogged.add(tag)
        return fast_route_answer(body, routing_metadata(next(self.endpoints), tag)) \
            .SerializeToString()

    def logged(self, batch: bytes) -> None:
        for entry in als_pb2.StreamAccessLogsMessage.FromString(batch).http_logs.log_entry:
            ours = entry.common_properties.metadata.filter_metadata.get(METADATA_NAMESPACE)
            if ours is not None:
                self.unlogged.discard(ours.fields[EXCHANGE_KEY].string_value)


class FloorExchange:
    """One ext_proc stream: the body message answered and the stream closed at once."""

    def __init__(self, stream: Stream, floor: Floor):
        self.stream, self.floor = stream, floor

    def message(self, data: bytes) -> None:
        message = ext.ProcessingRequest.FromString(data)
        kind = message.WhichOneof("request")
        if kind == "request_body":
            self.stream.send_and_close([self.floor.answer(message.request_body.body)])
        elif kind == "request_headers":
            self.stream.send_and_close([_LET_THROUGH])
        else:
            self.stream.close()

    def end(self) -> None:
        self.stream.close()

    def reset(self) -> None:
        pass


class FloorLog:
    """Envoy's access log stream: each batch's entries read, as the EPP reads them."""

    def __init__(self, stream: Stream, floor: Floor):
        self.stream, self.floor = stream, floor

    def message(self, data: bytes) -> None:
        self.floor.logged(data)

    def end(self) -> None:
        self.stream.close()

    def reset(self) -> None:
        pass


async def serve(port: int, endpoints: list[str]) -> None:
    floor = Floor(endpoints)

    def opener(stream: Stream, path: str, headers=()) -> FloorExchange | FloorLog | None:
        if path == PROCESS_METHOD:
            return FloorExchange(stream, floor)
        if path == ACCESS_LOG_METHOD:
            return FloorLog(stream, floor)
        return None

    sock, _ = grpc_socket(f"127.0.0.1:{port}")
    server = GrpcServer(opener, max_message=MAX_GRPC_MESSAGE)
    await server.start(sock)
    tune_gc_once_started()  # as the EPP does
    await asyncio.Event().wait()  # until the benchmark stops it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoints", required=True, help="IP:PORT,IP:PORT (round robin)")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.endpoints.split(",")))


if __name__ == "__main__":
    main()
