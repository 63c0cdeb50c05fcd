"""Prefill/decode disaggregation: a prefill engine and a decode engine (each its own driver actor and ranks) behind
one front end, with the prompt's KV moved rank to rank between them.

Why: under DP attention every rank enters every MoE collective, so one group's long prefill stalls every group's
decode step (SGLang's reason for PD with DP attention; DeepSeek's own deployment, llm-d and Dynamo's wide-EP recipes
split the same way). With the prefill on engines of its own, the decode engine's steps stay decode steps.

A request (:meth:`PDEngineClient.generate`):

1. **Decode side first**: the decode engine reserves KV slots for the prompt in its least loaded DP group
   (``Driver.reserve_kv``); the prefill starts only once it has (retried until ``reserve_timeout_s``, then 429).
2. **Prefill**: the prefill engine runs the request for one token with ``export_kv``: when it finishes, its
   prompt's KV stays locked in the prefill group's radix cache (``GroupState.kv_exports``). Its token is the
   stream's first. A request that ends there (a stop token, ``max_tokens=1``) ends the stream.
3. **Transfer**: each tp rank of the prefill group writes the prompt's rows into the same tp rank of the decode
   group's reserved slots (``raymoe.kvcache.kv_transfer``: NIXL, else gloo; agents started by the ranks, metadata
   passed through the driver actors), then the prefill side's lock is released. With NIXL (one-sided writes) the
   prefill ranks write them **layer by layer while they compute** (``layerwise``, the default): the request
   carries its destination (``raymoe.step.kv_stream.KVStreamTarget``), every prefill step writes the positions
   it computed (a radix hit's cached prefix in its first step) as each layer's KV is stored
   (``raymoe.kvcache.kv_stream``), and the step that computes the prompt's last chunk waits for its writes and
   notifies the decode ranks, which is all the decode side then waits for. With gloo the rows move after the
   prefill, in one two-sided send.
4. **Decode**: the request joins the decode group that holds the reservation with ``kv_received``: the reserved
   slots go to that group's radix cache as the prompt's KV, so the request computes only its first token's KV and
   decodes on (TBO, graphs and MIXED batches as usual; its rows continue from the first token).

Faults end in a stream that goes on or a clear error, and leave no KV held: a transfer that fails or times out
(``transfer_timeout_s``) falls back to the decode engine re-prefilling prompt + first token (the path of a resumed
request); a client that leaves aborts whichever side holds the request, and the reservation is freed only once the
transfer calls have returned and, for a streamed request, once no prefill step can write it any more
(``Driver.kv_stream_settled``; a late write must not land in slots another request got); a fault of either engine
is resumed by that engine's ``EngineClient`` as for any request. After a failed transfer the ranks' agents are
started again before the next one (a restarted rank group has none), and a clean-up call to an engine that went away
is logged, not raised (the engine took what it held with it).

Restrictions (checked at start-up, ``InvalidRequestError`` naming ``pd_decode``): both engines have the same TP
size, KV dtype and page size (rows move one for one), and run their DP groups' schedulers in the driver
(``group_schedulers="driver"``); the prefill engine keeps its radix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import uuid
from collections.abc import AsyncIterator

from raymoe.actors.records import RequestDelta
from raymoe.client.engine_client import EngineClient
from raymoe.config import EngineConfig
from raymoe.errors import InvalidRequestError
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.kv_stream import KVStreamTarget

log = logging.getLogger(__name__)

EXPECT_BOUND_S = 600.0
"""Longest a decode rank keeps progressing NIXL for one streamed request it was told to expect (the request's
receive or clean-up stops it sooner), seconds."""


async def _quietly(ref, what: str) -> None:
    """Await a clean-up call to an engine's driver; an engine that went away took what it held with it."""
    try:
        await ref
    except Exception as e:  # noqa: BLE001
        log.warning("PD clean-up call %s failed (%s); the engine that held it was restarted", what, e)


class PDEngineClient:
    """The two engines behind the OpenAI app (``EngineClient``'s interface; module docstring).

    Args:
        prefill, decode: the engines' configurations (``raymoe.client.pd_config.pd_engine_configs``).
        model_name: served model name. transfer_timeout_s: bound on one request's KV transfer, seconds.
        reserve_timeout_s: how long a request waits for KV room on the decode side, seconds.
        kv_backend: ``auto`` | ``nixl`` | ``gloo`` (``raymoe.kvcache.kv_transfer``).
        layerwise: stream the prompt's KV layer by layer during the prefill where the backend writes one-sided
            (NIXL); False: always after the prefill.

    Raises:
        InvalidRequestError: the engines cannot exchange KV (TP size, dtype, page size; names ``pd_decode``).
        EngineUnhealthyError: an engine failed to start.
    """

    def __init__(self, prefill: EngineConfig, decode: EngineConfig, model_name: str | None = None,
                 transfer_timeout_s: float = 30.0, reserve_timeout_s: float = 60.0, kv_backend: str = "auto",
                 layerwise: bool = True):
        import ray

        for name, mine, theirs in (("tp_size", prefill.parallel.tp_size, decode.parallel.tp_size),
                                   ("page_size", prefill.cache.page_size, decode.cache.page_size)):
            if mine != theirs:
                raise InvalidRequestError("pd_decode", f"the prefill and decode engines need the same {name} "
                                                       f"(KV rows move one for one), got {mine} and {theirs}")
        self.prefill = EngineClient(prefill, model_name)
        try:
            self.decode = EngineClient(decode, model_name)
        except BaseException:
            self.prefill.shutdown()
            raise
        self.transfer_timeout_s, self.reserve_timeout_s = transfer_timeout_s, reserve_timeout_s
        self.config, self.model_config = self.decode.config, self.decode.model_config
        self.model_name, self.tokenizer = self.decode.model_name, self.decode.tokenizer
        self.device_choice = self.decode.device_choice
        self.tp = self.decode.config.parallel.tp_size
        self.transfers_failed = 0
        self.kv_backend = kv_backend
        self.layerwise = layerwise
        self.streamed = 0  # transfers written layer by layer during the prefill
        self.reconnects = 0
        self._stale = False  # the ranks' agents must be started again (a rank group or driver was restarted)
        self._connect_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        metas = ray.get(self._start_refs(), timeout=300)
        self._streams = self._can_stream(metas)
        self._decode_ranks, self._prefill_ranks = (n[0] for n in ray.get(self._peer_refs(*metas), timeout=300))
        self._cleanups: set[asyncio.Task] = set()

    def _start_refs(self) -> list:
        """Start every rank's agent on both engines (fresh names each time): refs of (prefill, decode) metadata."""
        tag = uuid.uuid4().hex[:8]
        return [self.prefill.driver.start_kv_transfer.remote(f"pd{tag}-prefill", self.kv_backend),
                self.decode.driver.start_kv_transfer.remote(f"pd{tag}-decode", self.kv_backend)]

    def _can_stream(self, metas: list[list[bytes]]) -> bool:
        """Whether prefill ranks write KV layer by layer: asked for, and every agent writes one-sided."""
        return self.layerwise and all(pickle.loads(m)["backend"] == "nixl" for side in metas for m in side)

    @property
    def kv_streaming(self) -> bool:
        """Whether new requests' KV is written layer by layer during their prefill (``layerwise`` with NIXL)."""
        return self._streams and not self._stale

    def _peer_refs(self, metas_p: list[bytes], metas_d: list[bytes]) -> list:
        """Give each side's ranks the other's metadata (once both have started): refs of the peer names each
        prefill rank and each decode rank knows (decode rank names, prefill rank names), in rank order."""
        return [self.prefill.driver.add_kv_peers.remote(metas_d), self.decode.driver.add_kv_peers.remote(metas_p)]

    async def _reconnect_if_stale(self) -> None:
        """After a failed transfer, start the agents again before the next one (a restarted rank group has none;
        one request reconnects, the others wait for it)."""
        if not self._stale:
            return
        loop = asyncio.get_running_loop()
        if self._connect_lock is None or self._connect_lock[0] is not loop:
            self._connect_lock = (loop, asyncio.Lock())
        async with self._connect_lock[1]:
            if not self._stale:
                return
            try:
                metas = await asyncio.gather(*self._start_refs())
                names = await asyncio.gather(*self._peer_refs(*metas))
                self._streams = self._can_stream(metas)
                self._decode_ranks, self._prefill_ranks = names[0][0], names[1][0]
            except Exception as e:  # noqa: BLE001 - an engine is still restarting: this request re-prefills
                log.warning("reconnecting the KV transfer agents failed (%s); trying again at the next transfer", e)
                return
            self._stale = False
            self.reconnects += 1

    @property
    def max_context_len(self) -> int:
        return min(self.prefill.max_context_len, self.decode.max_context_len)

    async def _reserve(self, rid: str, n: int) -> tuple[int, list[int]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reserve_timeout_s
        while True:
            got = await self.decode.driver.reserve_kv.remote(rid, n)
            if got is not None:
                return got
            if loop.time() > deadline:
                raise InvalidRequestError("queue", "the decode engine has had no KV room for this prompt for "
                                                   f"{self.reserve_timeout_s:.0f} s; retry later")
            await asyncio.sleep(0.05)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas: the first from the prefill engine, the rest from the decode engine.

        Raises:
            InvalidRequestError: refused by either engine, or no KV room on the decode side in time (``queue``).
            EngineUnhealthyError: an engine failed and the request could not be resumed.
        """
        prompt = list(prompt_token_ids)
        group, slots = await self._reserve(request_id, len(prompt))
        target = None
        if self.kv_streaming:
            target = KVStreamTarget(request_id, tuple(self._decode_ranks[group * self.tp:(group + 1) * self.tp]),
                                    tuple(slots), self.transfer_timeout_s)
        held = {"reservation": True, "export": False, "streamed": target is not None, "expected": None}
        transfer: list = []
        try:
            if target is not None:  # the decode ranks keep UCX progressing while the rows arrive (not awaited:
                # the prefill need not wait for it; a write posted before the poller starts just lands later)
                held["expected"] = self.decode.driver.expect_kv.remote(group, request_id, EXPECT_BOUND_S)
            last = None
            async for delta in self.prefill.generate(request_id, prompt, dataclasses.replace(params, max_tokens=1),
                                                     export_kv=True, kv_stream=target):
                last = delta
            held["export"] = True
            if params.max_tokens == 1 or last.finish_reason != "length" or not last.token_ids:
                yield last  # the request ended at its first token
                return
            yield dataclasses.replace(last, finished=False, finish_reason=None)
            first, prefill_cached = last.token_ids[-1], last.cached_tokens
            if held["expected"] is not None:  # (in place long ago; so receive_kv's forget comes after it)
                await _quietly(held["expected"], "expect_kv")
            received = await self._transfer(request_id, group, slots, transfer)
            held["expected"] = None  # (receive_kv forgets the tag)
            held["reservation"] = not received
            held["export"] = False
            await _quietly(self.prefill.driver.release_export.remote(request_id), "release_export")
            if not received:  # the decode engine re-prefills prompt + first token instead
                self.transfers_failed += 1
                held["reservation"] = False
                await self._settled(request_id, held)
                await _quietly(self.decode.driver.cancel_reservation.remote(request_id), "cancel_reservation")
            async for delta in self.decode.generate(request_id, prompt, params, output_ids=[first],
                                                    kv_received=received):
                if delta.finished:  # usage: the prompt's cache hits were the prefill engine's
                    delta = dataclasses.replace(delta, cached_tokens=prefill_cached)
                yield delta
        finally:
            if held["reservation"] or held["export"]:
                self._clean_up(request_id, held, transfer, group)

    async def _transfer(self, rid: str, group: int, slots: list[int], calls: list) -> bool:
        """Move the prompt's KV from the prefill group holding it into ``slots`` of decode group ``group``;
        returns False when it could not (the caller falls back to a re-prefill)."""
        await self._reconnect_if_stale()
        try:
            export = await self.prefill.driver.kv_export.remote(rid)
        except Exception as e:  # noqa: BLE001 - the prefill engine's driver went away: re-prefill on decode
            log.warning("request %s: the prefill engine cannot be asked for its KV (%s)", rid, e)
            self._stale = True
            return False
        if export is None:
            log.warning("request %s: the prefill engine kept no KV to send", rid)
            return False
        pgroup, src, streamed = export
        tp = self.tp
        decode_peers = self._decode_ranks[group * tp:(group + 1) * tp]
        prefill_peers = self._prefill_ranks[pgroup * tp:(pgroup + 1) * tp]
        t = self.transfer_timeout_s
        if not streamed:  # written after the prefill (gloo, or a prefill that could not stream: one send)
            calls.append(self.prefill.driver.send_kv.remote(pgroup, decode_peers, src, slots, rid, t))
        calls.append(self.decode.driver.receive_kv.remote(group, prefill_peers, slots, rid, t))
        try:
            await asyncio.gather(*calls)
        except Exception as e:  # noqa: BLE001 - a failed transfer falls back to a re-prefill on the decode side
            log.warning("request %s: KV transfer failed (%s); the decode engine re-prefills it", rid, e)
            await asyncio.gather(*calls, return_exceptions=True)
            calls.clear()
            self._stale = True
            return False
        calls.clear()  # (cancelled: the calls stay, and the clean-up waits for them before freeing the slots)
        self.streamed += streamed
        return True

    async def _settled(self, rid: str, held: dict) -> None:
        """For a streamed request: wait until no prefill step can write into its reservation any more
        (``Driver.kv_stream_settled``; every step's writes land within ``transfer_timeout_s``). A prefill engine
        that went away took its ranks' writes with it."""
        if not held["streamed"]:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2 * self.transfer_timeout_s + 10.0
        while loop.time() < deadline:
            try:
                if await self.prefill.driver.kv_stream_settled.remote(rid):
                    return
            except Exception as e:  # noqa: BLE001
                log.warning("request %s: the prefill engine went away (%s); its writes went with it", rid, e)
                return
            await asyncio.sleep(0.02)
        log.warning("request %s: the prefill engine still streams its KV after %.0f s; freeing the reservation",
                    rid, 2 * self.transfer_timeout_s + 10.0)

    def _clean_up(self, rid: str, held: dict, transfer: list, group: int) -> None:
        """Free what ``rid`` still holds on both engines once its transfer calls (if any) have returned."""
        async def clean() -> None:
            if transfer:
                await asyncio.gather(*transfer, return_exceptions=True)
            if held["expected"] is not None:
                await _quietly(held["expected"], "expect_kv")
                await _quietly(self.decode.driver.forget_kv.remote(group, rid), "forget_kv")
            if held["reservation"]:
                await self._settled(rid, held)
            if held["export"]:
                await _quietly(self.prefill.driver.release_export.remote(rid), "release_export")
            if held["reservation"]:
                await _quietly(self.decode.driver.cancel_reservation.remote(rid), "cancel_reservation")

        task = asyncio.get_running_loop().create_task(clean())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def abort(self, request_id: str) -> None:
        """Nothing to send: the stream's exit aborts the side holding the request (``generate``)."""

    async def stats(self):
        """The decode engine's counters (where the streams run)."""
        return await self.decode.stats()

    async def cached_blocks(self) -> list[int]:
        """The prefill engine's cached prefix blocks (where a prompt's cache hits are; for a prefix-aware router in
        front of several PD pairs, ``raymoe.deploy.serve_router``)."""
        return await self.prefill.cached_blocks()

    async def healthy(self) -> bool:
        return await self.prefill.healthy() and await self.decode.healthy()

    async def health_detail(self) -> str:
        parts = [f"{name}: {d}" for name, d in (("prefill", await self.prefill.health_detail()),
                                                ("decode", await self.decode.health_detail())) if d]
        return "; ".join(parts)

    async def rebalance_experts(self) -> bool:
        return await self.decode.rebalance_experts()

    def shutdown(self) -> None:
        try:
            self.prefill.shutdown()
        finally:
            self.decode.shutdown()
