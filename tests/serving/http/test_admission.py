"""A number a client writes in a header is read bounded: past 4,300 digits ``int()`` raises,
and a header of 5,000 digits was a 500 with a traceback (issue 37, item 2)."""

from __future__ import annotations

import pytest

from serving.errors import PayloadTooLargeError
from serving.http.admission import check_length


@pytest.mark.parametrize("length", ["9" * 5000, b"9" * 5000, "0" * 4999 + "7"])
def test_a_content_length_of_thousands_of_digits_is_over_the_limit(length: str | bytes) -> None:
    with pytest.raises(PayloadTooLargeError) as caught:
        check_length(length, 1024)
    assert "is over the limit of 1024 bytes" in caught.value.message
    assert len(caught.value.message) < 200  # the header is quoted cut short


def test_declared_length_reads_what_a_length_can_be() -> None:
    from serving.http.admission import declared_length

    assert declared_length("1024") == 1024
    assert declared_length(b"0") == 0
    assert declared_length("12a") is None
    assert declared_length(None) is None
    assert declared_length("9" * 5000) == -1  # more than any limit, never read by int()
    check_length("1024", 1024)  # at the limit: passes
