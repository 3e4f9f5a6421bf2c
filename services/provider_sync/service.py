"""The provider service of a provider-sync process: its own PostgreSQL pool and its own Kafka
producer, logged in as the ``provider-sync`` principal (write ``sandbox.commands`` only).

Inside ``sandstream up`` the controller uses the API's service instead (one producer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from events.publisher import CommandPublisher
from services.api.gateway import CommandGateway
from services.api.providers import ProviderService
from services.api.readmodel import ChangeFeed
from services.common.database import connect_pool
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings


@asynccontextmanager
async def open_service(settings: Settings) -> AsyncIterator[ProviderService]:
    """A ProviderService with its own pool and publisher (the provider-sync command)."""
    pool = await connect_pool(settings)
    try:
        client = kafka_client_args(settings, "provider-sync")
        async with CommandPublisher(client, topic=settings.topic_commands) as pub:
            gateway = CommandGateway.of_role(settings, pool, pub, ChangeFeed(pool))
            yield ProviderService(settings, pool, gateway)
    finally:
        await pool.close()
