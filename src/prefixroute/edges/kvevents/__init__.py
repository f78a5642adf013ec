"""KV events transport: vLLM-compatible ZMQ publisher and subscriber (event types and codecs
are pure and live in ``prefixroute.core.kvevents``)."""

from prefixroute.edges.kvevents.zmq import (
    KVEventPublisher,
    KVEventSubscriber,
    ReceivedBatch,
    SubscriberStats,
    asyncio_queue_callback,
)

__all__ = ["KVEventPublisher", "KVEventSubscriber", "ReceivedBatch", "SubscriberStats",
           "asyncio_queue_callback"]
