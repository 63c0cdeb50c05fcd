"""Freeing KV for the next decode step of one DP group: evict, retract, or finish the last request.

Ownership: called by ``raymoe.scheduler.batch_formation`` before a decode batch, on the group's
:class:`~raymoe.scheduler.group_state.GroupState`. Order (SGLang's): evict cached prefixes; then retract the latest
admitted running request (least work lost) back to ``waiting`` (it later re-prefills ``origin_input_ids +
output_ids`` and continues); then the chunked request; and if the last running request still finds no slot, finish
it with LENGTH. The admission accounting makes that last case unreachable in normal operation; it keeps the group
from hanging if it ever happens (the request is reported through ``finished_outside_step``).
"""

from __future__ import annotations

from raymoe.scheduler.group_state import GroupState
from raymoe.scheduler.req import FinishKind, Req


def make_room_for_decode(state: GroupState) -> list[Req]:
    """Free KV until every running request can take one more slot (evict, retract, or finish the last); returns
    the requests to decode next (``GroupState.decoders`` once the room is made; empty when none runs)."""
    alloc, tree = state.token_allocator, state.tree_cache
    while state.running:
        decoders = state.decoders()
        short = alloc.decode_cost(state.last_slots(decoders)) - alloc.available_size()
        if short <= 0:
            return decoders
        if tree.evictable_size() > 0 and tree.evict(short) > 0:
            continue
        if len(state.running) > 1:
            victim = max(state.running, key=lambda r: r.admit_seq)  # latest admitted: least work lost
            state.running.remove(victim)
            retract(state, victim)
        elif state.chunked_req is not None:
            victim, state.chunked_req = state.chunked_req, None
            retract(state, victim)
        else:
            last = state.running.pop()
            last.finish(FinishKind.LENGTH, message="KV cache exhausted")
            state.unfinished.pop(last.rid, None)
            state.release(last, cache=True)
            state.finished_outside_step.append(last)
    return []


def retract(state: GroupState, req: Req) -> None:
    """Push ``req`` (already out of ``running``/``chunked_req``) back to ``waiting``, freeing its KV (its output so
    far is kept); admission then reserves the whole remaining output of new requests again (ratio 1.0)."""
    state.release(req, cache=False)
    req.num_retractions += 1
    state.num_retractions += 1
    state.waiting.append(req)
    state.new_token_ratio = 1.0
