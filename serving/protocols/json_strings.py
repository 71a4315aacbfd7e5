"""Strings in a JSON body's tensor data, found before numpy makes an array of them.

``np.asarray`` of a list that holds a string makes a ``<U{longest}`` array: every element as
wide as the longest string, four bytes a character. One row of a 1 MB string and 7 empty ones
cost 32 MB, and a 1,024-wide model would have taken 4 GB from the same megabyte. No served
model takes strings, so a string in the data is refused, and it must be found without that
array and without a Python step per number on the usual path (the body's numbers are what a
request is made of).

A string in the text is two ``"``; the body's ``"`` are counted at memory speed
(``bytes.count``) and set against those its keys and its strings outside the data take
(``string_quotes``, a lower bound: two each). Only a body with more ``"`` than that may hold a
string in its data, and only its data is then walked for one (``holds_string``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["holds_string", "string_quotes"]


def string_quotes(value: Any, data_key: str = "data") -> int:
    """Two for each key and each string in the parsed JSON ``value``: at least as many ``"`` as
    they took in its text (an escaped one takes more). The value under a key ``data_key`` is
    not walked (the tensor data, counted by the caller's own means). A step per object, list
    and string only: what every JSON infer request pays (orjson gives exact types)."""
    count = 0
    stack = [value]
    pop, push = stack.pop, stack.append
    while stack:
        item = pop()
        kind = type(item)
        if kind is dict:
            count += 2 * len(item)
            for key, child in item.items():
                of = type(child)
                if of is str:
                    count += 2
                elif (of is dict or of is list) and key != data_key:
                    push(child)
        elif kind is list:
            for child in item:
                of = type(child)
                if of is str:
                    count += 2
                elif of is dict or of is list:
                    push(child)
        elif kind is str:
            count += 2
    return count


def holds_string(value: Any) -> bool:
    """Whether the parsed JSON ``value`` holds a string in its (nested) lists, walked without
    recursion (a body may nest as deep as the parser lets it)."""
    if isinstance(value, str):
        return True
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            for child in item:
                if isinstance(child, str):
                    return True
                if isinstance(child, list):
                    stack.append(child)
    return False
