"""Stop strings over a token stream: where the text must end, and which tokens count. Pure.

The worker stops on token ids; strings are found here, on the detokenized stream, one token at
a time — so the earliest match wins even when one message carries a whole verify step's accepted
run, and no token after the one that completed the match is emitted. As OpenAI and vLLM do, the
stop string itself is not part of the text; the token completing it is counted in usage. Text
that could still be the start of a stop string is held back until the next token decides::

    tokens  ──StreamDecoder (per token)──▶ text ──▶ [emitted | held back: a prefix of a stop?]
                                                     match found ─▶ text before it, stop here
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.common.errors import InvalidArgument
from services.common.tokenizer import StreamDecoder, Tokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def validate_stop_strings(stops: Iterable[str]) -> tuple[str, ...]:
    """De-duplicated stop strings (order kept); InvalidArgument for empty or too many/long ones."""
    out = tuple(dict.fromkeys(stops))
    if len(out) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(out)}")
    for s in out:
        if not isinstance(s, str) or not s:
            raise InvalidArgument("stop strings must be non-empty strings")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop strings are at most {MAX_STOP_CHARS} characters")
    return out


class StopScanner:
    """One stream's scan (mutates its own buffers). ``push(ids)`` returns (text to emit now,
    the number of those ids that count when a stop string completed among them, else None)."""

    def __init__(self, stops: Sequence[str], tokenizer: Tokenizer):
        self._stops = tuple(stops)
        self._longest = max(map(len, self._stops))
        self._decoder = StreamDecoder(tokenizer)
        self._pending = ""  # decoded, not emitted (could be the start of a stop string)
        self.stopped = False

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def push(self, ids: Sequence[int]) -> tuple[str, int | None]:
        if self.stopped:
            raise InvalidArgument("the stream already stopped")
        out = []
        for n, token in enumerate(ids, 1):
            text = self._pending + self._decoder.push([token])
            # a match can only start in the held-back part or the new text
            hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
            if hits:
                self.stopped = True
                self._pending = ""
                out.append(text[: min(hits)])
                return "".join(out), n
            keep = self._held(text)
            out.append(text[: len(text) - keep])
            self._pending = text[len(text) - keep :]
        return "".join(out), None

    def flush(self) -> tuple[str, bool]:
        """What is left when the stream ended, and whether it holds a stop string after all (text
        the decoder held back as an incomplete character is only decoded now)."""
        text = self._pending + self._decoder.flush()
        self._pending = ""
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            return text[: min(hits)], True
        return text, False
