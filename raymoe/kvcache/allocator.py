"""Free lists for KV token slots and ReqToTokenPool rows.

Ownership: both allocators live on the driver, next to the scheduler and its ``RadixCache``. They hand out plain
``int`` indices; ranks only ever see the numbers (in ``out_cache_loc``, ``prefix_slots`` and ``req_pool_indices``),
never the allocator. Nothing here touches torch.

Both are a LIFO stack of free indices plus a set of indices currently handed out, so that ``alloc`` and ``free``
cost O(n) for n indices with the per-index work done by C list/set operations, double frees are caught in O(n),
and allocation order depends only on the sequence of calls (reproducible runs). A fresh allocator hands out the
lowest indices first, in ascending order; after that the most recently freed indices are reused first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class _IndexAllocator:
    """Hands out the integers ``first .. first + size - 1``; shared logic of the two public allocators."""

    def __init__(self, size: int, first: int):
        if size < 1:
            raise ValueError(f"allocator size must be >= 1, got {size}")
        self.size = size
        self._first = first
        self._end = first + size  # one past the last index
        self.reset()

    def reset(self) -> None:
        """Make every index free again (anything handed out before is forgotten, not returned)."""
        # Stack top is the list end; keep the lowest index on top so a fresh allocator counts upwards.
        self._free: list[int] = list(range(self._end - 1, self._first - 1, -1))
        self._used: set[int] = set()

    def available_size(self) -> int:
        """Number of free indices."""
        return len(self._free)

    def _take(self, n: int) -> list[int] | None:
        if n <= 0:
            if n < 0:
                raise ValueError(f"cannot allocate a negative number of indices ({n})")
            return []
        free = self._free
        if n > len(free):
            return None
        out = free[: -n - 1 : -1]  # the top n entries, top first
        del free[-n:]
        self._used.update(out)
        return out

    def _give(self, indices: list[int]) -> None:
        used = self._used
        if not used.issuperset(indices) or len(set(indices)) != len(indices):
            raise ValueError(self._describe_bad_free(indices))
        used.difference_update(indices)
        self._free.extend(reversed(indices))  # freeing what alloc returned restores the previous stack order

    def _describe_bad_free(self, indices: list[int]) -> str:
        seen: set[int] = set()
        for i in indices:
            if not self._first <= i < self._end:
                reserved = " (reserved dummy slot)" if i == 0 and self._first == 1 else ""
                return f"index {i}{reserved} is outside the pool [{self._first}, {self._end})"
            if i not in self._used or i in seen:
                return f"index {i} is not currently allocated (double free)"
            seen.add(i)
        return "invalid free"  # unreachable: _give only calls this when some index is bad


class TokenSlotAllocator(_IndexAllocator):
    """KV slots ``1 .. size`` (slot 0 is the reserved dummy slot that padded rows write to; never handed out).

    A slot holds the keys and values of one token in every layer of a rank's ``TokenToKVPool``; the pools are
    therefore ``size + 1`` slots long. Units are tokens (one slot per token, no pages). The scheduler talks to it
    through the same methods as ``raymoe.kvcache.paged_allocator.PagedTokenSlotAllocator`` (``page_size == 1``:
    ``after`` is ignored, a decode token costs one slot, every cached prefix can be shared, nothing is stranded).

    Args:
        size: usable slots, ``>= 1``. Raises ``ValueError`` otherwise.

    Attributes:
        size: usable slots (constant). page_size: 1.
    """

    page_size = 1

    def __init__(self, size: int):
        super().__init__(size, first=1)

    def alloc(self, n: int, after: int | None = None) -> list[int] | None:
        """Allocate ``n`` slots (``after``, the request's last slot, only matters to the paged allocator).

        Returns:
            ``n`` distinct free slots, or ``None`` (and nothing allocated) when fewer than ``n`` are free.
            ``n == 0`` returns ``[]``.

        Raises:
            ValueError: ``n < 0``.
        """
        return self._take(n)

    def decode_cost(self, last_slots: Sequence[int]) -> int:
        """Free slots one more token for each of these requests consumes: one each."""
        return len(last_slots)

    def alloc_decode(self, last_slots: Sequence[int]) -> list[int] | None:
        """One slot per request, or ``None`` (nothing allocated) when too few are free."""
        return self._take(len(last_slots))

    def aligned_prefix_len(self, slots: Sequence[int]) -> int:
        """Tokens of a cached match a request may share: all of them."""
        return len(slots)

    def room_after(self, after: int | None) -> int:
        """Slots a request can take without free ones: none (no pages)."""
        return 0

    def stranded_size(self) -> int:
        """Slots neither free nor handed out: none."""
        return 0

    def free(self, slots: Iterable[int]) -> None:
        """Return ``slots`` to the pool.

        Raises:
            ValueError: a slot is 0, out of range, not currently allocated, or repeated in ``slots``
                (double free). On error nothing is freed.
        """
        self._give(slots if isinstance(slots, list) else list(slots))

    def free_tail(self, slots: Sequence[int]) -> None:
        """Return a request's trailing ``slots`` (:meth:`free`; the paged allocator also rewinds their pages)."""
        self.free(list(slots))


class ReqSlotAllocator(_IndexAllocator):
    """Rows ``0 .. size - 1`` of the ReqToTokenPool table (one per running request).

    Args:
        size: number of rows, ``>= 1``. Raises ``ValueError`` otherwise.

    Attributes:
        size: number of rows (constant).
    """

    def __init__(self, size: int):
        super().__init__(size, first=0)

    def alloc(self) -> int | None:
        """Allocate one row; ``None`` when every row is in use."""
        if not self._free:
            return None
        idx = self._free.pop()
        self._used.add(idx)
        return idx

    def free(self, idx: int) -> None:
        """Return row ``idx``.

        Raises:
            ValueError: ``idx`` is out of range or not currently allocated (double free).
        """
        if idx not in self._used:
            raise ValueError(self._describe_bad_free([idx]))
        self._used.remove(idx)
        self._free.append(idx)
