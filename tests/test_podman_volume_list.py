"""A volume list that Podman 4.3 answers 500 "no such volume" (a volume it matched removed
while it read them: another sandbox's delete in flight) is asked again, never raised to a
reconcile or a delete (drivers/podman_objects.list_volumes). Podman's race cannot be timed
from outside, so its answer is given by a stand-in client; the list itself is Podman's."""

from __future__ import annotations

from typing import Any

import pytest
from podman.errors import APIError

from drivers.podman_objects import VOLUME_LIST_ATTEMPTS, list_volumes

RACED = "no volume with name sandstream-x-1 found in database: no such volume"


class Volumes:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.asked: list[list[str]] = []

    def list(self, filters: list[str]) -> list[str]:
        self.asked.append(filters)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


class Client:
    def __init__(self, answers: list[Any]) -> None:
        self.volumes = Volumes(answers)


def test_a_list_raced_by_a_removal_is_asked_again() -> None:
    client = Client([APIError(RACED), APIError(RACED), ["v1", "v2"]])
    assert list_volumes(client, "k=v") == ["v1", "v2"]  # type: ignore[arg-type]
    assert client.volumes.asked == [["label=k=v"]] * 3


def test_another_error_or_a_race_that_never_ends_is_raised() -> None:
    client = Client([APIError("permission denied")])
    with pytest.raises(APIError, match="permission denied"):
        list_volumes(client, "k=v")  # type: ignore[arg-type]
    client = Client([APIError(RACED)] * VOLUME_LIST_ATTEMPTS)
    with pytest.raises(APIError, match="no such volume"):
        list_volumes(client, "k=v")  # type: ignore[arg-type]
    assert len(client.volumes.asked) == VOLUME_LIST_ATTEMPTS
