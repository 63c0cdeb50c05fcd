"""Page-granular KV slot allocator, for attention kernels that read the cache through a block table.

Ownership: like ``TokenSlotAllocator``, it lives on the driver next to the scheduler and the ``RadixCache`` and
hands out plain ``int`` slots; ranks see only the numbers.

Layout: page ``p`` is the run of slots ``[p * page_size, (p + 1) * page_size)``. Page 0 is reserved (it holds the
dummy slot 0 that padded rows write to), so pages ``1 .. num_pages`` are handed out and the ranks' pools are
``(num_pages + 1) * page_size`` rows long. The guarantee a paged kernel needs: for every request, each aligned run
of ``page_size`` positions ``[j * page_size, (j + 1) * page_size)`` of its sequence lies at consecutive slots of a
single page, starting at the page's first slot. Then position ``i`` lives at slot
``block_table[i // page_size] * page_size + i % page_size`` with ``block_table[j] = slot_of(j * page_size) //
page_size`` (``raymoe.platform.cuda.flash_attn``).

How the scheduler keeps the guarantee (see ``raymoe.scheduler``):

* a request's own positions come from :meth:`alloc` with ``after`` = its last slot: the rest of its current page
  first, then fresh pages, so the tail of a request's last page is used only by that request;
* a radix-cache hit is cut to :meth:`aligned_prefix_len` (whole pages that are laid out as above; a cached path
  can mix two requests' pages mid-page), so the request's own slots start on a fresh page;
* a page goes back to the free list when every slot handed out from it has been freed (a request's unused tail,
  and the slots of tokens someone else had cached first, are "stranded" until then: :meth:`stranded_size`).

The radix tree itself stays token-granular; the cost of this design is the stranded slots, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from raymoe.kvcache.allocator import TokenSlotAllocator, _IndexAllocator


class PagedTokenSlotAllocator:
    """KV slots handed out in pages of ``page_size`` tokens (see the module docstring).

    Args:
        num_pages: usable pages (page 0 is reserved), ``>= 1``. page_size: tokens per page, ``>= 1``.

    Raises:
        ValueError: ``num_pages < 1`` or ``page_size < 1``.

    Attributes:
        page_size: tokens per page. size: usable slots, ``num_pages * page_size`` tokens (constant).
    """

    def __init__(self, num_pages: int, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.size = num_pages * page_size
        self._pages = _IndexAllocator(num_pages, first=1)  # raises on num_pages < 1
        self.reset()

    def reset(self) -> None:
        """Make every page free again (anything handed out before is forgotten, not returned)."""
        self._pages.reset()
        self._fill: dict[int, int] = {}  # page -> slots handed out from it so far (its next offset)
        self._live: dict[int, int] = {}  # page -> slots handed out from it and not freed yet
        self._used: set[int] = set()

    def available_size(self) -> int:
        """Slots of the free pages (tokens a request starting on a fresh page can get)."""
        return self._pages.available_size() * self.page_size

    def stranded_size(self) -> int:
        """Slots of pages in use that are neither handed out nor free (unused page tails, freed duplicates)."""
        return len(self._fill) * self.page_size - len(self._used)

    def room_after(self, after: int | None) -> int:
        """Slots left in the page of ``after``, a request's last slot (0 when ``after`` is None or ends its page):
        the request can grow by that many tokens without a free page.

        Raises:
            ValueError: ``after`` is not the last slot handed out from its page.
        """
        if after is None or (after + 1) % self.page_size == 0:
            return 0
        page = after // self.page_size
        if after not in self._used or self._fill.get(page) != after % self.page_size + 1:
            raise ValueError(f"slot {after} is not the last slot handed out from page {page}")
        return self.page_size - after % self.page_size - 1

    def alloc(self, n: int, after: int | None = None) -> list[int] | None:
        """``n`` slots for the next ``n`` positions of a request whose last slot is ``after`` (``None``: the request
        starts on a fresh page): the rest of ``after``'s page, then fresh pages, in position order.

        Returns:
            the slots, or ``None`` (and nothing allocated) when too few pages are free. ``n == 0`` returns ``[]``.

        Raises:
            ValueError: ``n < 0``, or ``after`` is not the last slot handed out from its page.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        ps = self.page_size
        tail = min(n, self.room_after(after))
        pages = self._pages._take(-(-(n - tail) // ps))
        if pages is None:
            return None
        out = list(range(after + 1, after + 1 + tail)) if tail else []
        if tail:
            page = after // ps
            self._fill[page] += tail
            self._live[page] += tail
        rest = n - tail
        for page in pages:
            k = min(ps, rest)
            out.extend(range(page * ps, page * ps + k))
            self._fill[page] = self._live[page] = k
            rest -= k
        self._used.update(out)
        return out

    def decode_cost(self, last_slots: Sequence[int]) -> int:
        """Free slots (whole pages) that one more token for each request with these last slots consumes."""
        return self.page_size * sum((s + 1) % self.page_size == 0 for s in last_slots)

    def alloc_decode(self, last_slots: Sequence[int]) -> list[int] | None:
        """One slot per request (its next position), or ``None`` (nothing allocated) when pages run short."""
        if self.decode_cost(last_slots) > self.available_size():
            return None
        return [self.alloc(1, s)[0] for s in last_slots]

    def aligned_prefix_len(self, slots: Sequence[int]) -> int:
        """Longest prefix of a cached match ``slots`` a request may share: whole pages, each laid out from its
        first slot in position order (tokens; a multiple of ``page_size``)."""
        ps = self.page_size
        for start in range(0, len(slots) // ps * ps, ps):
            first = slots[start]
            if first % ps or any(slots[start + i] != first + i for i in range(1, ps)):
                return start
        return len(slots) // ps * ps

    def free(self, slots: Iterable[int]) -> None:
        """Return ``slots``; a page whose handed-out slots are all free goes back to the free list.

        Raises:
            ValueError: a slot is not currently handed out, or repeated in ``slots`` (nothing is freed then).
        """
        slots = slots if isinstance(slots, list) else list(slots)
        if not self._used.issuperset(slots) or len(set(slots)) != len(slots):
            bad = next((s for i, s in enumerate(slots) if s not in self._used or s in slots[:i]), None)
            raise ValueError(f"slot {bad} is not currently allocated (double free, or never handed out)")
        self._used.difference_update(slots)
        emptied = []
        for s in slots:
            page = s // self.page_size
            self._live[page] -= 1
            if self._live[page] == 0:
                emptied.append(page)
        for page in emptied:
            del self._live[page], self._fill[page]
        self._pages._give(emptied)


    def free_tail(self, slots: Sequence[int]) -> None:
        """Return a request's trailing ``slots`` (its last positions, in position order, e.g. the rejected draft
        tokens of a speculative step) so that the request can grow into them again: each page's handed-out count
        is rewound to the first of them (the tail of a request's last page is only ever that request's, module
        docstring). Pages left without live slots go back to the free list.

        Raises:
            ValueError: as :meth:`free` (nothing is freed then).
        """
        slots = list(slots)
        self.free(slots)
        ps = self.page_size
        for s in slots:
            page = s // ps
            if page in self._fill:
                self._fill[page] = min(self._fill[page], s % ps)


def make_token_allocator(max_total_tokens: int, page_size: int) -> TokenSlotAllocator | PagedTokenSlotAllocator:
    """The KV slot allocator of one DP group: token-granular for ``page_size == 1``, else
    ``max_total_tokens // page_size`` pages (see :func:`pool_slots` for the ranks' matching pool size)."""
    if page_size == 1:
        return TokenSlotAllocator(max_total_tokens)
    return PagedTokenSlotAllocator(max_total_tokens // page_size, page_size)


def pool_slots(max_total_tokens: int, page_size: int) -> int:
    """KV slots the ranks' pools need besides dummy slot 0 so that :func:`make_token_allocator`'s slots fit and the
    pool is a whole number of pages: ``(max_total_tokens // page_size + 1) * page_size - 1``."""
    return (max_total_tokens // page_size + 1) * page_size - 1
