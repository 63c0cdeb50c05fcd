"""Layer-by-layer KV writes of a prefill rank (prefill/decode disaggregation): a step's streamed prompt rows go to
the decode ranks layer by layer while the forward computes the later layers.

Mechanism: the forward's op list ends every decoder layer with a mark (``raymoe.overlap.strategy.KVLayerMark``).
When every half of the step (one, or the two children of a two-batch-overlap step) has passed layer l's mark, the
rows of that layer are in the pool, and the step's :class:`KVLayerStream` hands a job to its rank's writer thread:
one NIXL ``WRITE`` per decode peer of the pages of layer l's buffers holding the step's chunks
(``raymoe.step.kv_stream.KVStreamChunk``). On a CUDA rank the mark records an event on the current stream and the
writer waits for it before it posts, so the launch thread never blocks on the device. After the forward (and the
draft model's passes, which write the draft layer's rows) :meth:`KVLayerStream.finish` posts the layers no mark
covered, waits until every write of the step has landed or its bound passed, and notifies the decode rank of each
request whose last chunk this was: its tag, or the tag with ``FAILED_SUFFIX`` when one of the request's writes on
this rank failed (the decode side then re-prefills instead of waiting out its timeout). Writes of one step land
before the next step's writes start, so a page written by two steps (a chunk boundary inside a page) ends with the
later step's rows.

This is how NIXL-based PD systems hide the transfer behind the prefill (vLLM's and LMCache's layer-wise
connectors follow the same save-after-each-layer shape); with the two-sided gloo fallback the rows move after the
prefill instead (``KVTransferAgent.streams`` is False).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from raymoe.kvcache.kv_layout import KVLayout
from raymoe.kvcache.kv_transfer import KVTransferError
from raymoe.step.kv_stream import FAILED_SUFFIX, KVStreamChunk

log = logging.getLogger(__name__)

_POLL_S = 0.0002


class KVStreamer:
    """A rank's writer of streamed KV (module docstring): its agent, pool layout and writer thread.

    Args:
        agent: the rank's KV transfer agent (``streams`` must be True: ``NixlKVTransfer``).
        layout: the rank's pool as the agent registered it.

    Raises:
        ValueError: an agent that cannot write one-sided.
    """

    def __init__(self, agent, layout: KVLayout):
        if not getattr(agent, "streams", False):
            raise ValueError(f"KV transfer backend {agent.backend!r} cannot stream rows layer by layer")
        self.agent, self.layout = agent, layout
        self.cuda = layout.device_type == "cuda"
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="raymoe-kv-stream")
        self._failed: set[str] = set()  # tags with a failed write on this rank, until their last chunk
        self.writes = self.failures = 0  # writes posted; requests reported failed to their decode rank

    def begin(self, chunks: Sequence[KVStreamChunk], tp_rank: int) -> KVLayerStream:
        """The stream of one step's ``chunks`` as TP rank ``tp_rank`` writes them.

        Raises:
            ValueError: a chunk's source and destination slots touch different numbers of pages, or it names no
                peer for ``tp_rank``.
        """
        return KVLayerStream(self, chunks, tp_rank)

    def close(self) -> None:
        self._writer.shutdown(wait=True)


class KVLayerStream:
    """One step's layer-by-layer writes (module docstring); built by :meth:`KVStreamer.begin`.

    Attributes:
        children: halves of the step that pass each layer's mark (2 for a two-batch-overlap step; set by the
            runner once it has split the step).
    """

    def __init__(self, streamer: KVStreamer, chunks: Sequence[KVStreamChunk], tp_rank: int):
        self.streamer, self.chunks, self.children = streamer, list(chunks), 1
        layout = streamer.layout
        per_peer: dict[str, tuple[list[int], list[int]]] = {}
        for c in self.chunks:
            if tp_rank >= len(c.peers):
                raise ValueError(f"KV stream {c.tag!r} names {len(c.peers)} decode peers, none for TP rank {tp_rank}")
            src, dst = layout.pages_touched(c.src_slots), layout.pages_touched(c.dst_slots)
            if len(src) != len(dst):
                raise ValueError(f"KV stream {c.tag!r}: source slots touch {len(src)} pages, destination slots "
                                 f"{len(dst)} (slots must be laid out by page on both sides)")
            pages = per_peer.setdefault(c.peers[tp_rank], ([], []))
            pages[0].extend(src)
            pages[1].extend(dst)
        self.peers = per_peer
        self.tp_rank = tp_rank
        self.timeout_s = max(c.timeout_s for c in self.chunks)
        self._passed: dict[int, int] = {}  # id(forward batch) -> layers it has passed
        self._events: dict[int, list] = {}  # CUDA: layer -> events recorded at its marks
        self._next = 0  # first layer not posted yet
        self._jobs: list[Future] = []

    def layer_done(self, layer: int, forward_batch) -> None:
        """The mark at the end of decoder layer ``layer`` in the half ``forward_batch`` of the step; posts every
        layer that all halves have passed."""
        if self.streamer.cuda:
            event = torch.cuda.Event()
            event.record()
            self._events.setdefault(layer, []).append(event)
        self._passed[id(forward_batch)] = layer + 1
        if len(self._passed) == self.children:
            self._post_upto(min(self._passed.values()))

    def _post_upto(self, end: int) -> None:
        end = min(end, self.streamer.layout.num_layers)
        for layer in range(self._next, end):
            self._jobs.append(self.streamer._writer.submit(self._post, layer, self._events.pop(layer, ())))
        self._next = max(self._next, end)

    def _post(self, layer: int, events) -> list[tuple[str, object]]:
        """Writer thread: wait for the layer's rows on the device, then one write per peer."""
        for event in events:
            event.synchronize()
        handles = []
        for peer, (src, dst) in self.peers.items():
            try:
                handles.append((peer, self.streamer.agent.post_write(peer, src, dst, [layer])))
            except Exception as e:  # noqa: BLE001 - recorded; finish() reports it to the decode rank
                handles.append((peer, e))
        return handles

    def finish(self) -> None:
        """After the step's forward: post the remaining layers, wait for every write (bounded by the chunks'
        ``timeout_s``), then notify the decode ranks of the requests whose last chunk this was. Never raises:
        a failed or late write becomes the request's failure notification (and a log line)."""
        streamer = self.streamer
        if streamer.cuda:
            for layer in range(self._next, streamer.layout.num_layers):
                event = torch.cuda.Event()
                event.record()
                self._events[layer] = [event]
        self._post_upto(streamer.layout.num_layers)
        deadline = time.monotonic() + self.timeout_s
        failed_peers: dict[str, str] = {}
        pending = []
        for job in self._jobs:
            for peer, handle in job.result():
                if isinstance(handle, BaseException):
                    failed_peers[peer] = str(handle)
                else:
                    pending.append((peer, handle))
        streamer.writes += len(pending)
        try:
            while pending:
                still = []
                for peer, handle in pending:
                    state = streamer.agent.write_state(handle)
                    if state not in ("DONE", "ERR"):
                        still.append((peer, handle))
                        continue
                    streamer.agent.release(handle)
                    if state == "ERR":
                        failed_peers[peer] = "NIXL reported an error"
                if still and time.monotonic() > deadline:
                    for peer, handle in still:
                        failed_peers[peer] = f"not landed within {self.timeout_s} s"
                        streamer.agent.release(handle)
                    still = []
                pending = still
                if pending:
                    time.sleep(_POLL_S)
        except KVTransferError as e:  # the agent itself failed: every peer of the step failed
            failed_peers.update({peer: str(e) for peer in self.peers})
        self._notify(failed_peers)

    def _notify(self, failed_peers: dict[str, str]) -> None:
        streamer = self.streamer
        for c in self.chunks:
            peer = c.peers[self.tp_rank]
            if peer in failed_peers:
                if c.tag not in streamer._failed:
                    log.warning("KV stream %s to %s: %s; the decode side re-prefills it", c.tag, peer,
                                failed_peers[peer])
                streamer._failed.add(c.tag)
            if not c.last:
                continue
            failed = c.tag in streamer._failed
            streamer._failed.discard(c.tag)
            streamer.failures += failed
            try:
                streamer.agent.notify(peer, c.tag + (FAILED_SUFFIX if failed else ""))
            except Exception as e:  # noqa: BLE001 - the decode side times out and re-prefills
                log.warning("KV stream %s: notifying %s failed (%s)", c.tag, peer, e)
