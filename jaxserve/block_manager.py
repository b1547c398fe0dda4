"""KV page allocation. Plain Python: no jax here.

Pages 1..num_pages-1 are handed to sequences; page 0 is the padding sink and never allocated.
Invariant (checked by `check`): every page is either free or owned by exactly one sequence.
"""

from __future__ import annotations

from collections import deque

from jaxserve.sequence import Sequence


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2: page 0 is reserved for padding (got {num_pages})")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._owner: dict[int, int] = {}  # page -> seq_id

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return len(self._owner)

    def num_new_pages(self, seq: Sequence, num_tokens: int) -> int:
        """Pages `seq` still needs to hold `num_tokens` tokens."""
        return max(0, pages_for(num_tokens, self.page_size) - len(seq.page_ids))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_pages(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.page_ids` to cover `num_tokens` tokens."""
        need = self.num_new_pages(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV pages: need {need}, {len(self._free)} free")
        for _ in range(need):
            page = self._free.popleft()
            self._owner[page] = seq.seq_id
            seq.page_ids.append(page)

    def free(self, seq: Sequence) -> None:
        for page in seq.page_ids:
            del self._owner[page]
            self._free.append(page)
        seq.page_ids = []

    def check(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        if free & set(self._owner):
            raise AssertionError("a page is both free and owned")
        if len(free) + len(self._owner) != self.num_pages - 1:
            raise AssertionError(
                f"page accounting broken: {len(free)} free + {len(self._owner)} used != {self.num_pages - 1} total"
            )
