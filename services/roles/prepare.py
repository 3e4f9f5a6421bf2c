"""`sandstream prepare`: what the separate roles need before they start, done once (and
idempotent): the Kafka topics, the PostgreSQL migrations, the API tokens file and the
credentials key. ``sandstream up`` does the same for itself."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
from aiokafka.errors import KafkaError

from services.common.credentials import create_key_file
from services.common.kafka_clients import KafkaCredentialsError
from services.common.migrations import MigrationError, apply_migrations
from services.common.settings import Settings
from services.common.tokens import TokenFileError, ensure_tokens
from services.localstack import stack

log = logging.getLogger("sandstream.prepare")


def prepare(settings: Settings) -> str | None:
    """Ready topics, schema, tokens and key; None when done, else what failed."""
    try:
        stack.ensure_topics(settings)
    except (stack.StackError, KafkaCredentialsError) as exc:
        return f"the Kafka topics are not ready: {exc}"
    except (OSError, KafkaError) as exc:
        return f"cannot reach Kafka at {settings.kafka_bootstrap}: {exc!r}"
    schema = None if settings.pg_schema == "public" else settings.pg_schema
    try:
        asyncio.run(apply_migrations(settings.pg_dsn, schema=schema))
    except (OSError, asyncpg.PostgresError, MigrationError) as exc:
        return f"cannot migrate PostgreSQL: {exc!r}"
    try:
        tokens = ensure_tokens(settings)
    except TokenFileError as exc:
        return str(exc)
    if tokens.created:
        log.info("created the tokens file %s and the admin token %s",
                 tokens.tokens_file, tokens.admin_token_file)  # fmt: skip
    if settings.credentials_key is None and create_key_file(settings.credentials_key_path):
        log.info("created the credentials key %s (mode 0600)", settings.credentials_key_path)
    return None
