"""The codec's shortcut is the schema's own behaviour: ``encode`` writes what
``model_dump_json`` writes."""

from __future__ import annotations

import factories as f
from pydantic import BaseModel

from events.codec import encode
from projections.lifecycle import decide


def test_encode_writes_what_model_dump_json_writes() -> None:
    messages: list[BaseModel] = [
        f.create("codec-a"), f.stop("codec-a"), f.running("codec-a", 1),
        f.exited("codec-a", 1, exit_code=3), f.failed("codec-a", 1, reason="r\x01é"),
    ]  # fmt: skip
    decision = decide(None, messages[0], f.cause(messages[0]))  # type: ignore[arg-type]
    messages += [*decision.events, *([decision.outcome] if decision.outcome else [])]
    assert len(messages) > 5
    for message in messages:
        assert encode(message) == message.model_dump_json().encode()
