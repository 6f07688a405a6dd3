"""sao_core.closing: closing what a constructor or a set-up step opened when it fails half-way."""

from __future__ import annotations

import pytest

from sao_core.closing import close_on_error


class _Resource:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_close_on_error_closes_only_when_the_block_raises_and_re_raises_the_same_error():
    resource = _Resource()
    with close_on_error(resource):
        pass
    assert resource.closed == 0
    for error in (OSError("no pod"), KeyboardInterrupt()):
        with pytest.raises(type(error)) as raised:
            with close_on_error(resource):
                raise error
        assert raised.value is error
    assert resource.closed == 2
