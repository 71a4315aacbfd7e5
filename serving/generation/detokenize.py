"""Text out of generated ids as they come (a stream's), and the ``stop`` strings cut from it.

Decoding each token alone is wrong twice over: a byte-level BPE token may hold half of a UTF-8
character (its text alone is U+FFFD), and SentencePiece drops the leading space of a piece decoded
without its left neighbour. ``IncrementalText`` decodes a window of the ids (TGI's and vLLM's
``prefix_offset``/``read_offset``): the text of the ids before the newest, and of them with the
newest; what the second adds is new text, held back while it ends in U+FFFD (an incomplete
character: the next token completes it).

``StopCut`` holds back the end of the text that could still become a stop string, so that a
stop string spanning tokens is cut exactly: the client never sees any of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.generation.tokenizer import TextTokenizer

__all__ = ["IncrementalText", "StopCut"]

_INCOMPLETE = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # the window's start: ids before it are out already
        self._read = 0  # ids whose text is out

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read])
        after = decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """The text still held at the end (an incomplete character stays U+FFFD, as the
        whole text's decode writes it)."""
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read])
        after = decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""


class StopCut:
    """The text with the first of ``stops`` cut off, handed out as it is decided."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._text = ""
        self._out = 0  # characters of _text handed out
        self.stopped = False

    def push(self, text: str) -> str:
        """Add decoded text; the part now known not to start a stop string. After a stop
        string, ``stopped`` is set and nothing more comes out."""
        if self.stopped:
            return ""
        start = max(0, self._out - max((len(s) for s in self._stops), default=0))
        self._text += text
        cut = min(
            (at for at in (self._text.find(s, start) for s in self._stops) if at >= 0),
            default=-1,
        )
        if cut >= 0:
            self.stopped = True
            self._text = self._text[:cut]
            return self._take(len(self._text))
        return self._take(len(self._text) - self._held())

    def flush(self) -> str:
        """What was held back, at the end of a sequence that met no stop string."""
        return "" if self.stopped else self._take(len(self._text))

    def _held(self) -> int:
        """The longest end of the text that begins some stop string."""
        text = self._text
        held = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held

    def _take(self, end: int) -> str:
        end = max(end, self._out)
        piece = self._text[self._out : end]
        self._out = end
        return piece
