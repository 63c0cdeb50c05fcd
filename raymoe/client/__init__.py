"""Clients of driver actors over Ray: one engine's (``EngineClient``), a prefill/decode pair's (``PDEngineClient``)
and blocking calls over either (``BlockingClient``), used by the HTTP front end and the Engine API's PD mode."""
