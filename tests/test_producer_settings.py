"""Every Kafka producer of the product acknowledges a record only once the in-sync replicas
have it (``acks="all"``; with three brokers ``min.insync.replicas=2``) and is idempotent, so a
retried send is never written twice. Checked in the source: a new producer must say both."""

from __future__ import annotations

import ast
from pathlib import Path

from services.common.settings import PROJECT_ROOT

# The benchmarks' load generators are not the product.
EXCLUDED = ("services/bench/",)


def producer_calls() -> list[tuple[str, ast.Call]]:
    found = []
    for layer in ("events", "projections", "drivers", "services"):
        for path in sorted((PROJECT_ROOT / layer).rglob("*.py")):
            name = str(path.relative_to(PROJECT_ROOT))
            if name.startswith(EXCLUDED):
                continue
            for node in ast.walk(ast.parse(Path(path).read_text())):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", "") == "AIOKafkaProducer"
                ):
                    found.append((f"{name}:{node.lineno}", node))
    return found


def test_every_product_producer_uses_acks_all_and_idempotence() -> None:
    calls = producer_calls()
    # The processor's (replaced after any error), the one every other role's producer makes
    # (replaced after an ACL refusal: RenewingProducer), and the chaos checker's load.
    made_in = {where.split(":")[0] for where, _ in calls}
    assert made_in == {
        "services/processor/publish.py", "events/publisher.py", "services/chaos/run.py"
    }  # fmt: skip
    for where, call in calls:
        given = {k.arg: k.value for k in call.keywords}
        assert isinstance(given.get("acks"), ast.Constant), where
        assert given["acks"].value == "all", where
        idempotence = given.get("enable_idempotence")
        assert isinstance(idempotence, ast.Constant) and idempotence.value is True, where
