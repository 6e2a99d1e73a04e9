"""The gateway's shared-prefix header on the engine hop: parsed strictly (a 400 naming it), and
turned into the shared tokens of the exact prompt."""

from __future__ import annotations

import pytest

from engine.server.shared_prefix import common_start, salt_with_prefix
from portico.contract import (
    SHARED_PREFIX_HEADER,
    SharedPrefix,
    shared_prefix_of,
    with_shared_prefix,
)
from portico.errors import InvalidRequestError


def test_the_header_names_characters_and_salt() -> None:
    assert shared_prefix_of({}) is None
    found = shared_prefix_of({SHARED_PREFIX_HEADER: "120;shared-prefix:corp"})
    assert found == SharedPrefix(120, "shared-prefix:corp")
    # a salt may hold the separator itself: only the first one splits
    assert shared_prefix_of({SHARED_PREFIX_HEADER: "5;a;b"}) == SharedPrefix(5, "a;b")


@pytest.mark.parametrize(
    "value", ["", "12", "x;salt", "0;salt", "-3;salt", "7;", "7;" + "s" * 1025]
)
def test_a_malformed_header_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        shared_prefix_of({SHARED_PREFIX_HEADER: value})
    assert exc.value.status_code == 400 and exc.value.param == SHARED_PREFIX_HEADER


def test_the_shared_tokens_are_the_common_start_of_prompt_and_prefix() -> None:
    assert common_start([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_start([1, 2], [1, 2, 3]) == 2
    assert common_start([], [1]) == 0
    shared = SharedPrefix(10, "plan")
    # the prefix rendered alone ends with an end-of-turn token the prompt does not have there
    salt = salt_with_prefix("tenant", shared, [5, 6, 7, 8, 9], [5, 6, 7, 0])
    assert salt == with_shared_prefix("tenant", "plan", 3)
