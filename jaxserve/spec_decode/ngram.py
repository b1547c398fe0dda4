"""N-gram (prompt lookup) proposer: guess that the text continues as it did after the last earlier occurrence of
its current ending. Host side, no model: strong on code edits, summaries and chat that quote the prompt.

For n from `max_n` down to `min_n`: take the sequence's last n tokens, find their most recent earlier occurrence
in the sequence, and propose the (up to) k tokens that followed it. No match -> no drafts.
"""

from __future__ import annotations

import numpy as np

from jaxserve.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    """Drafts are known before scheduling (a host lookup, no pages needed); no state to roll back."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def draft(self, seq, k: int) -> list[int]:
        return self.propose(seq.token_ids, k)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        L = len(token_ids)
        if k <= 0 or L < self.min_n + 1:
            return []
        toks = np.asarray(token_ids, np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = toks[L - n :]
            # windows[i] = toks[i : i + n] for every start i whose window ends before the tail starts
            windows = np.lib.stride_tricks.sliding_window_view(toks[: L - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence; drafts continue after it
                return toks[start : start + k].tolist()
        return []
