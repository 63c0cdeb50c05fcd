"""The front end's output reader (``EngineClient._pump``) survives connections closed under it: a DP group's output
connection the accept thread replaced (a group process reconnecting) or closed, while the reader was about to wait
on it, must not end the thread that delivers every stream's tokens."""

from __future__ import annotations

from multiprocessing import Pipe

from raymoe.actors.channel import ChannelListener
from raymoe.client.engine_client import EngineClient


def test_a_group_connection_closed_under_the_reader_is_dropped_not_raised():
    listener = ChannelListener()
    try:
        driver_end, engine_end = Pipe()
        closed, _peer = Pipe()
        closed.close()  # replaced by the accept thread just before the reader built its wait list
        listener.group_conns[0] = closed
        client = EngineClient.__new__(EngineClient)  # only the reader's state: no engine behind it
        client._channel, client._streams = listener, {}
        engine_end.close()  # then the driver goes away: the pump returns why instead of raising
        reason = client._pump(driver_end)
        assert "driver went away" in reason
        assert 0 not in listener.group_conns
    finally:
        listener.close()
