"""A create from a pooled template whose claim's adoption the gateway cannot publish: the
answer is the one a create's own publish gets (503 UNAVAILABLE over HTTP, UNAVAILABLE over
OpenShell, naming the create's id to retry with), not a 500 or INTERNAL. The gateway raised
PublishFailed for the adoption (services/api/claims.py), and neither door caught it on the
claim path. Real PostgreSQL and Kafka; a publish timeout of 0 gives up before Kafka can
acknowledge, as when a broker does not answer in time; the pool's Ready member is a row."""

from __future__ import annotations

import uuid
from typing import Any

import apikit
import grpc
from apikit import unique
from harness import isolated_env
from test_openshell_handlers import SCOPE, door_channel, failure, rpc

from events.common import SandboxSpec
from events.publisher import CommandPublisher, now
from services.api.gateway import CommandGateway
from services.api.readmodel import ChangeFeed
from services.common import pools, templates
from services.common.kafka_clients import kafka_client_args
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1


async def pooled_template(pool: Any) -> str:
    """A template with a warm pool of one Ready member (a row: no processor runs here)."""
    template, name = unique("tpl"), unique("pool")
    async with pool.acquire() as conn:
        body = templates.TemplateBody(spec=SandboxSpec(image="registry.example/agent:1"))
        await templates.create_template(conn, template, body, "t", now())
        await pools.create_pool(conn, name, template, 1, "Recreate", "t", now())
        await conn.execute(
            "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers,"
            " identity, created_at, updated_at, partition, change_seq, pool) VALUES ($1, $2,"
            " 'Ready', 1, 2, '{\"image\": \"x\"}', '{}', 'i', now(), now(), 0, 1, $3)",
            f"{name}-abcd1234",
            uuid.uuid4(),
            name,
        )
    return template


async def test_an_adoption_kafka_does_not_acknowledge_is_503_over_http() -> None:
    async with apikit.running_api(None, publish_timeout=0) as api, api.client() as c:
        template = await pooled_template(api.env.pool)
        body = {"name": unique("claim"), "template": {"name": template}, "command_id": "c-claim"}
        r = await c.post("/v1/sandboxes", json=body)
    assert r.status_code == 503, r.text
    assert (r.json()["code"], r.json()["command_id"]) == ("UNAVAILABLE", "c-claim"), r.text
    assert "retry with the same command_id 'c-claim'" in r.json()["message"], r.text


async def test_an_adoption_kafka_does_not_acknowledge_is_unavailable_over_openshell() -> None:
    async with (
        isolated_env(partitions=1) as env,
        CommandPublisher(
            kafka_client_args(env.settings, "api"), topic=env.settings.topic_commands
        ) as publisher,
    ):
        template = await pooled_template(env.pool)
        gateway = CommandGateway(env.pool, publisher, ChangeFeed(env.pool), publish_timeout=0)
        request = os1.CreateSandboxRequest(
            name=unique("claim"),
            workspace_scope=SCOPE,
            workload_template=template,
            request_id="req-claim",
        )
        async with door_channel(env.settings, env.pool, gateway) as channel:
            lost = await failure(rpc(channel, "CreateSandbox", request, os1.SandboxResponse))
    assert lost.code() == grpc.StatusCode.UNAVAILABLE, lost
    assert "retry with the same request_id" in (lost.details() or "")
    assert "req-claim" in (lost.details() or "")
