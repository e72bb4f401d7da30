"""Generated ids to the text a client sees: end-of-generation ids dropped, no UTF-8 character split, stop strings."""
from __future__ import annotations

from collections.abc import Sequence

from strata_nb.model.tokenizer import StreamDecoder, Tokenizer


class TextStream:
    """push() each generated id, flush() at the end; the pieces add up to the decoded text (as `generate` prints
    it) cut before the first stop string. Text that could still become a stop string is held back (up to the longest
    stop string's length less one character), so a streamed answer never shows a stop string's beginning."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._dec = StreamDecoder(tokenizer, lstrip_first=False)  # the answer continues the prompt
        self._eog = set(tokenizer.eog_ids)
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""  # decoded, not handed on yet
        self.stopped = False  # a stop string was seen: nothing more comes out

    def push(self, tid: int) -> str:
        if self.stopped or tid in self._eog:
            return ""
        self._text += self._dec.push(tid)
        return self._take(final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        self._text += self._dec.flush()
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        hits = [i for i in (self._text.find(s) for s in self._stop) if i >= 0]
        if hits:
            out, self._text, self.stopped = self._text[:min(hits)], "", True
            return out
        n = len(self._text) if final else max(0, len(self._text) - self._hold)
        out, self._text = self._text[:n], self._text[n:]
        return out
