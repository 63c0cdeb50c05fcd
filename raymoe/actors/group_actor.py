"""GroupSchedulerActor: one DP group's :class:`~raymoe.actors.group_server.GroupServer` in a process of its own, on
the node of the group's ranks (``raymoe.actors.group_hosts`` creates and places it).

The actor's process holds the group's scheduler, radix cache and KV allocators, its ranks' step channel (its own
:class:`~raymoe.actors.step_channel.StepChannelHub`: each rank receives its batch from its group's process, over a
Unix socket on their node) and its output connection to the front end. Ray calls only set it up
(:meth:`rank_channel`, :meth:`accept_ranks`, :meth:`connect_driver`, :meth:`connect_outputs`); the step traffic is
one command and one reply per step on the driver's link, served by a thread (``raymoe.actors.group_link.
serve_group``). It reserves no CPU of its own (the ranks' bundles do) and dies with the driver actor that owns it.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from typing import Any

from raymoe.actors.frontends import OutputFanout
from raymoe.actors.private_socket import Address, connect_private
from raymoe.actors.step_channel import StepChannelHub
from raymoe.config import EngineConfig
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch

log = logging.getLogger(__name__)


class HubRanks:
    """:class:`~raymoe.actors.group_server.GroupRanks` over a group's own step channel hub.

    Args:
        hub: the hub its ``tp`` ranks connected to. step_timeout_s: bound on one step, seconds.
    """

    def __init__(self, hub: StepChannelHub, step_timeout_s: float):
        self.hub, self.step_timeout_s = hub, step_timeout_s

    def launch(self, batch: ModelWorkerBatch) -> Any:
        return self.hub.send([batch])

    def collect(self, handle: Any) -> StepOutput:
        return self.hub.gather(handle, self.step_timeout_s)[0]

    def alive(self) -> bool:
        return self.hub.healthy


class OutputPublisher:
    """Sends a group's output rows to the front ends' channels, each front end its own requests' rows
    (``raymoe.actors.frontends.OutputFanout``)."""

    def __init__(self):
        self.fanout = OutputFanout(lambda conn, batch: conn.send_bytes(
            pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)))
        self.publish = self.fanout.publish

    def connect(self, address: Address, authkey: bytes, index: int, frontend: str = "") -> None:
        """Connect to front end ``frontend``'s channel as group ``index`` (replaces its previous connection).

        Raises:
            OSError / multiprocessing.AuthenticationError: the channel cannot be reached or refused the key.
        """
        conn = connect_private(address, authkey)
        conn.send(("group", index))
        old = self.fanout.connect(frontend, conn)
        if old is not None:
            old.close()

    def disconnect(self, frontend: str) -> None:
        """Stop sending to front end ``frontend`` (it went away)."""
        self.fanout.drop(frontend)


class GroupSchedulerActor:
    """DP group ``index`` of the engine ``config`` (module docstring).

    Args:
        index: the group's DP rank. config: the engine configuration. tp_size: ranks in the group (global ranks
            ``index * tp_size`` ..). Loads the model folder's tokenizer and config (stop strings, EOS, vocab).
    """

    def __init__(self, index: int, config: EngineConfig, tp_size: int):
        from functools import partial

        from raymoe.actors.group_scheduler import GroupScheduler
        from raymoe.actors.group_server import GroupServer
        from raymoe.actors.process_tuning import configure_driver_gc
        from raymoe.config import ModelConfig
        from raymoe.tokenizer import detokenizer, eos_token_ids, load_tokenizer

        self.index = index
        model_config = ModelConfig.from_hf(config.model)
        tokenizer = load_tokenizer(config.model)
        make_group = partial(GroupScheduler, index, config, eos_token_ids(model_config, tokenizer),
                             detokenizer(tokenizer), model_config.vocab_size)
        self.hub = StepChannelHub(tp_size, tp_size, first_rank=index * tp_size)
        self.outputs = OutputPublisher()
        self.server = GroupServer(make_group(), HubRanks(self.hub, config.step_timeout_s), self.outputs.publish,
                                  make_group)
        configure_driver_gc()  # the driver's GC policy: start-up heap frozen, rarer young collections

    def rank_channel(self) -> tuple[Address, bytes]:
        """Where the group's ranks connect (``RankWorker.start_step_channel``)."""
        return self.hub.path, self.hub.authkey

    def accept_ranks(self, timeout_s: float) -> bool:
        """Wait until every rank of the group connected.

        Raises:
            TimeoutError: not within ``timeout_s`` seconds.
        """
        self.hub.accept(timeout_s)
        return True

    def connect_driver(self, address: Address, authkey: bytes) -> bool:
        """Connect to the driver's link listener, say which group this is, and serve its commands on a thread."""
        from raymoe.actors.group_link import serve_group

        conn = connect_private(address, authkey)
        conn.send(self.index)
        threading.Thread(target=serve_group, args=(conn, self.server), name=f"raymoe-group-{self.index}",
                         daemon=True).start()
        return True

    def connect_outputs(self, address: Address, authkey: bytes, frontend: str = "") -> bool:
        """Send front end ``frontend``'s output rows of this group to its channel at ``address`` (replaces that
        front end's previous one; ``raymoe.actors.frontends``)."""
        self.outputs.connect(address, authkey, self.index, frontend)
        return True

    def disconnect_outputs(self, frontend: str) -> bool:
        """Stop sending rows to front end ``frontend`` (it went away)."""
        self.outputs.disconnect(frontend)
        return True

    def pid(self) -> int:
        return os.getpid()
