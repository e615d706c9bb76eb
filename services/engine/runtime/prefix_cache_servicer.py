"""The ``tandem.v1.PrefixCache`` gRPC servicer: a worker's :class:`PrefixCacheFeed` as a stream.

Every prefill and decode worker serves it next to its role's service, so a KV-aware router
(``services/gateway/prefix_index.py``) can follow which prompt prefixes each worker holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc.aio

from services.common.pb import prefix_cache_pb2, prefix_cache_pb2_grpc
from services.engine.runtime.prefix_cache_feed import PrefixCacheFeed

SERVICE_NAME = prefix_cache_pb2.DESCRIPTOR.services_by_name["PrefixCache"].full_name


class PrefixCacheServicer(prefix_cache_pb2_grpc.PrefixCacheServicer):
    """``Watch``: a snapshot, then the changes, until the client leaves or the worker stops."""

    def __init__(self, feed: PrefixCacheFeed, *, worker_id: str, block_size: int) -> None:
        self.feed = feed
        self.worker_id = worker_id
        self.block_size = block_size

    async def Watch(
        self,
        request: prefix_cache_pb2.WatchPrefixCacheRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[prefix_cache_pb2.PrefixCacheUpdate]:
        subscription = await self.feed.subscribe()
        try:
            sequence = 0
            while True:
                change = await subscription.next()  # typed errors end the stream with a status
                yield prefix_cache_pb2.PrefixCacheUpdate(
                    snapshot=change.snapshot,
                    stored=change.stored,
                    removed=change.removed,
                    block_size=self.block_size,
                    worker_id=self.worker_id,
                    sequence=sequence,
                )
                sequence += 1
        finally:
            self.feed.unsubscribe(subscription)
