"""KV page allocation with reference counts and automatic prefix caching. Plain Python: no jax here.

Page 0 is the padding sink and never handed out. Every other page is in exactly one of three states:
  free     ref 0, no content worth keeping              (`_free`, a FIFO)
  cached   ref 0, holds a full page of known tokens     (`_evictable`, LRU order; reusable until evicted)
  in use   ref >= 1, listed in some sequences' page_ids (`_ref`)
so `free + cached + in use == num_pages - 1` (`check()`).

Prefix caching: once a sequence's page is full and computed, it is registered under a hash chained over all
tokens up to the end of that page: hash(parent_hash, page tokens). A new sequence whose prompt starts with the same
tokens takes those pages (ref += 1) instead of recomputing them. Shared pages are full, and a sequence only ever
writes at positions past its computed prefix, so shared pages are never written. When a page's last user lets go,
a registered page becomes `cached` (most recently freed = last evicted; a sequence's tail pages go first), an
unregistered one `free`. Allocation prefers free pages and evicts the least recently used cached page otherwise.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from jaxserve.sequence import Sequence


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2: page 0 is reserved for padding (got {num_pages})")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(1, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self._ref: dict[int, int] = {}  # in-use page -> number of sequences holding it
        self._by_hash: dict[int, int] = {}  # registered hash -> page
        self._page_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # page -> (hash, its tokens), for exact matching
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of which served from cache

    # ---- accounting -----------------------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take right now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return len(self._ref)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def check(self) -> None:
        free, cached, used = set(self._free), set(self._evictable), set(self._ref)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        if free & cached or free & used or cached & used:
            raise AssertionError("a page is in two states at once")
        if len(free) + len(cached) + len(used) != self.num_pages - 1:
            raise AssertionError(
                f"page accounting broken: {len(free)} free + {len(cached)} cached + {len(used)} in use "
                f"!= {self.num_pages - 1} total"
            )
        if any(r < 1 for r in self._ref.values()):
            raise AssertionError("an in-use page has a reference count below 1")
        if any(self._by_hash.get(h) != p for p, (h, _) in self._page_key.items()):
            raise AssertionError("hash index out of sync with page keys")

    # ---- allocation -----------------------------------------------------------------------------------------

    def num_new_pages(self, seq: Sequence, num_tokens: int) -> int:
        """Pages `seq` still needs to hold `num_tokens` tokens."""
        return max(0, pages_for(num_tokens, self.page_size) - len(seq.page_ids))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_pages(seq, num_tokens) <= self.num_free_pages

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.page_ids` to cover `num_tokens` tokens."""
        need = self.num_new_pages(seq, num_tokens)
        if need > self.num_free_pages:
            raise RuntimeError(f"out of KV pages: need {need}, {self.num_free_pages} free")
        for _ in range(need):
            page = self._free.popleft() if self._free else self._evict()
            self._ref[page] = 1
            seq.page_ids.append(page)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s pages past those holding `num_tokens` tokens (rejected speculative slots)."""
        keep = pages_for(num_tokens, self.page_size)
        while len(seq.page_ids) > keep:
            self._release(seq.page_ids.pop())
        del seq.page_hashes[keep:]

    def _release(self, page: int) -> None:
        self._ref[page] -= 1
        if self._ref[page] == 0:
            del self._ref[page]
            if page in self._page_key:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def _evict(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        h, _ = self._page_key.pop(page)
        del self._by_hash[h]
        return page

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s pages (tail first, so a prefix outlives its tails in the LRU order)."""
        for page in reversed(seq.page_ids):
            self._release(page)
        seq.page_ids = []
        seq.page_hashes = []

    def discard(self, seq: Sequence) -> None:
        """Release `seq`'s pages like `free`, but first drop from the prefix cache every page only `seq` holds: its
        KV may be garbage (a request that failed in a step), and no later request may reuse it. Pages shared with a
        live sequence stay cached (that sequence's own output depends on them being right)."""
        for page in seq.page_ids:
            if self._ref.get(page) == 1 and page in self._page_key:
                h, _ = self._page_key.pop(page)
                del self._by_hash[h]
        self.free(seq)

    def forget(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the prefix-cache registration of `seq`'s pages past its first `num_tokens` tokens where only `seq`
        holds them: a step that failed was to write their KV (async scheduling registers pages at dispatch)."""
        keep = num_tokens // self.page_size
        for page in seq.page_ids[keep : len(seq.page_hashes)]:
            if self._ref.get(page) == 1 and page in self._page_key:
                h, _ = self._page_key.pop(page)
                del self._by_hash[h]
        del seq.page_hashes[keep:]

    # ---- prefix caching -------------------------------------------------------------------------------------

    def _page_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.page_size : (i + 1) * self.page_size])

    def reuse_prefix(self, seq: Sequence) -> int:
        """Attach cached pages matching the start of a not-yet-computed sequence; return tokens now computed.

        At least one token is always left to compute, since the step must produce the next token's logits.
        """
        assert seq.num_computed_tokens == 0 and not seq.page_ids
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # prompt log-probabilities need every prompt token computed
        max_pages = (seq.num_tokens - 1) // self.page_size
        parent = None
        for i in range(max_pages):
            tokens = self._page_tokens(seq, i)
            h = hash((parent, tokens))
            page = self._by_hash.get(h)
            if page is None or self._page_key[page][1] != tokens:
                break
            if page in self._evictable:
                del self._evictable[page]
            self._ref[page] = self._ref.get(page, 0) + 1
            seq.page_ids.append(page)
            seq.page_hashes.append(h)
            parent = h
        hit = len(seq.page_ids) * self.page_size
        seq.num_computed_tokens = hit
        return hit

    def num_cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Tokens at the start of `token_ids` that `reuse_prefix` would find cached now, in whole pages (read-only:
        for routing requests between engine replicas)."""
        if not self.enable_prefix_caching:
            return 0
        parent, n = None, 0
        for i in range((len(token_ids) - 1) // self.page_size):
            tokens = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            h = hash((parent, tokens))
            page = self._by_hash.get(h)
            if page is None or self._page_key[page][1] != tokens:
                break
            parent, n = h, n + self.page_size
        return n

    def count_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Statistics for admitted sequences: `num_hit` of `num_tokens` came from the prefix cache."""
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: cached pages become free. Only while no sequence holds a page (a running
        sequence's registered pages stay valid for it); otherwise False and nothing changes."""
        if self._ref:
            return False
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._by_hash.clear()
        self._page_key.clear()
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Register `seq`'s newly full, computed pages so later sequences can reuse them."""
        if not self.enable_prefix_caching:
            return
        # a page holding a token still being sampled (async scheduling) waits until the token is known
        full = min(min(seq.num_computed_tokens, seq.num_known_tokens) // self.page_size, len(seq.page_ids))
        parent = seq.page_hashes[-1] if seq.page_hashes else None
        for i in range(len(seq.page_hashes), full):
            tokens = self._page_tokens(seq, i)
            h = hash((parent, tokens))
            page = seq.page_ids[i]
            if h not in self._by_hash and page not in self._page_key:
                self._by_hash[h] = page
                self._page_key[page] = (h, tokens)
            seq.page_hashes.append(h)
            parent = h
