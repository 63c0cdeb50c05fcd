"""KV cache sizing and scheduling limits of one DP-attention group (option declarations: ``raymoe.config.option``)."""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.config.option import check_choices, option
from raymoe.errors import InvalidRequestError
from raymoe.kvcache.paged_allocator import pool_slots


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing for one DP-attention group; each field's help says what it means.

    Raises:
        InvalidRequestError: a field out of range (names it).
    """

    max_total_tokens: int = option(
        16384, help="KV slots (tokens) in the pool of each DP group, not counting dummy slot 0; with pages the usable "
                    "pool is this rounded down to whole pages.")
    max_context_len: int = option(
        2048, help="longest sequence (prompt + output), tokens; also the width of the ReqToTokenPool rows.")
    enable_radix_cache: bool = option(True, help="share the KV of common prompt prefixes between requests.")
    swa_kv_eviction: bool = option(
        False, help="models with sliding-window layers (gpt-oss): keep those layers' KV in a ring of sliding_window "
                    "slots per request row and the token pool for the full-attention layers only, so a token costs "
                    "the full layers' bytes (raymoe.kvcache.swa_ring). Switches radix-cache prefix hits off; not with "
                    "prefill/decode disaggregation.")
    page_size: int | None = option(
        None, help="tokens per KV page: slots are handed out in pages, and each aligned run of page_size positions "
                   "of a request lies in one page (raymoe.kvcache.paged_allocator; block-table kernels need it). "
                   "None: the attention backend's default, which EngineConfig fills in (1 for torch_native, 16 for "
                   "flash_attn); a standalone CacheConfig reads it as 1 (page_tokens).")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_total_tokens < 2:
            raise InvalidRequestError("max_total_tokens", "must be >= 2")
        if self.max_context_len < 2:
            raise InvalidRequestError("max_context_len", "must be >= 2")
        if self.page_size is not None and (not isinstance(self.page_size, int) or self.page_size < 1):
            raise InvalidRequestError("page_size", f"must be a positive integer or None, got {self.page_size!r}")
        if self.max_total_tokens < self.page_tokens:
            raise InvalidRequestError("max_total_tokens", f"must hold at least one page ({self.page_tokens} tokens)")

    @property
    def page_tokens(self) -> int:
        """Tokens per KV page: ``page_size``, or 1 when unset."""
        return self.page_size or 1

    @property
    def kv_pool_slots(self) -> int:
        """KV slots each rank's pool allocates besides dummy slot 0: the allocator's pages plus the reserved
        page 0, so the pool is a whole number of pages (``max_total_tokens`` when ``page_tokens == 1``)."""
        return pool_slots(self.max_total_tokens, self.page_tokens)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-DP-group scheduling limits; each field's help says what it means.

    Raises:
        InvalidRequestError: a field out of range or not among its choices (names it).
    """

    max_running_requests: int = option(
        64, help="most requests in one decode batch of a DP group (also the ReqToTokenPool rows).")
    chunked_prefill_size: int | None = option(
        512, help="most prompt tokens prefilled in one step, longer prompts are chunked; None disables chunking "
                  "(one prompt may then exceed max_prefill_tokens on its own).")
    max_prefill_tokens: int = option(4096, help="token budget of one prefill batch.")
    schedule_policy: str = option(
        "fcfs", choices=("fcfs", "lpm"), help="order of the waiting requests: fcfs (first come, first served) or lpm "
                                              "(longest prefix match first).")
    max_queued_requests: int = option(
        4096, help="waiting requests of a DP group accepted before new ones are refused (HTTP 429).")
    enable_mixed_chunk: bool = option(
        True, help="a prefill step also decodes every running request (MIXED batches), so new prompts do not stall "
                   "the running streams (SGLang's --enable-mixed-chunk).")
    disable_overlap_schedule: bool = option(
        False, help="run the driver's steps one at a time. By default the driver forms and sends step N+1 while the "
                    "ranks compute step N (zero-overhead scheduling, raymoe.actors.driver); greedy outputs are the "
                    "same either way.")
    load_balance_method: str = option(
        "prefix_aware", choices=("prefix_aware", "shortest_queue"),
        help="how the driver picks a new request's DP group: prefix_aware (the group whose radix cache holds the "
             "longest prefix of its prompt, within the load bound prefix_routing_max_load_ratio; "
             "raymoe.actors.dp_router) or shortest_queue (the least loaded group).")
    prefix_routing_max_load_ratio: float = option(
        1.25, help="prefix_aware routing sends a request to the group holding its prefix only while that group's "
                   "load (requests) stays within this multiple of the mean load, so no group falls behind the others "
                   "(>= 1.0; 1.0 routes by load unless loads tie).")

    def __post_init__(self) -> None:
        check_choices(self)
        if not self.prefix_routing_max_load_ratio >= 1.0:
            raise InvalidRequestError("prefix_routing_max_load_ratio", "must be >= 1.0")
        if self.max_running_requests < 1:
            raise InvalidRequestError("max_running_requests", "must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise InvalidRequestError("chunked_prefill_size", "must be >= 1 or None")
        if self.max_prefill_tokens < 1:
            raise InvalidRequestError("max_prefill_tokens", "must be >= 1")
        if self.max_queued_requests < 1:
            raise InvalidRequestError("max_queued_requests", "must be >= 1")

    @property
    def req_pool_rows(self) -> int:
        """ReqToTokenPool rows a group needs (a chunk-prefilling request counts as running)."""
        return self.max_running_requests
