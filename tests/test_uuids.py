"""The fast uuid5 gives exactly the standard library's value (ids are recorded in the log)."""

from __future__ import annotations

import pickle
import uuid

from hypothesis import given
from hypothesis import strategies as st

from projections.uuids import uuid5


@given(namespace=st.uuids(), name=st.text())
def test_uuid5_is_the_standard_librarys(namespace: uuid.UUID, name: str) -> None:
    ours, theirs = uuid5(namespace, name), uuid.uuid5(namespace, name)
    assert ours == theirs
    assert (str(ours), ours.hex, ours.version, ours.variant) == (
        str(theirs), theirs.hex, 5, uuid.RFC_4122,
    )  # fmt: skip
    assert hash(ours) == hash(theirs)
    assert pickle.loads(pickle.dumps(ours)) == theirs
