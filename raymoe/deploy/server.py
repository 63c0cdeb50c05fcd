"""``raymoe serve``: start the engine and serve the OpenAI API with uvicorn until Ctrl-C / SIGTERM.

Stopping: the first SIGTERM or Ctrl-C drains (``shutdown.DrainingServer``: new requests 503, those in flight get
``shutdown_timeout_s`` to finish, the rest end with a ``server_shutdown`` error event), then the engine (driver,
ranks) and the local Ray this command started are stopped and it exits 0. A second signal ends the requests in
flight at once with that event (exit 1), a third drops them.

Start-up, each step with a progress bar: the demo checkpoint (built on first use), a local Ray on 127.0.0.1 (or
the cluster at ``--address``), the device decision (``--device cuda`` where Ray declares no GPU fails here, before
any actor starts), the driver actor and its rank actors (their start-up lines, ``raymoe start-up: ...``: ranks
placed, weights loaded, decode graphs captured, reach this console through Ray's log forwarding), then uvicorn.
When the server answers, the URL, the device and a ``curl`` line are printed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import urllib.request

from tqdm import tqdm

from raymoe.deploy.drain_config import DrainConfig
from raymoe.deploy.server_config import ServeOptions


def curl_example(base_url: str, model: str, needs_key: bool) -> str:
    """A copy-pasteable ``curl`` chat completion against the server. The API key itself is never printed: with
    ``needs_key`` the line reads it from ``$RAYMOE_API_KEY`` in the user's shell."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "def fib(n):"}], "max_tokens": 32})
    auth = ' -H "Authorization: Bearer $RAYMOE_API_KEY"' if needs_key else ""
    return f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def _demo_request(base_url: str, model: str, api_key: str | None) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "def fib(n):"}], "max_tokens": 32,
            "temperature": 0}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        print(f"demo request -> {json.dumps(answer['choices'][0]['message']['content'])} "
              f"(usage {answer['usage']['prompt_tokens']}+{answer['usage']['completion_tokens']} tokens)",
              flush=True)
    except Exception as e:  # noqa: BLE001 - a demo nicety; the server keeps running
        print(f"demo request failed: {e}", file=sys.stderr, flush=True)


def _raise_system_exit(signum, frame) -> None:
    raise SystemExit(0)  # a requested, graceful stop


async def _serve(server, base_url: str, banner: str, on_ready) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(banner, flush=True)
        if on_ready is not None:
            threading.Thread(target=on_ready, daemon=True).start()
    await task


def run_server(opts: ServeOptions, host: str = "127.0.0.1", port: int = 8000, demo_request: bool = False,
               log_level: str = "info", drain: DrainConfig | None = None) -> None:
    """Start the engine described by ``opts`` and serve it on ``host:port`` until a signal stops it (``drain``:
    how; None: the ``DrainConfig`` defaults).

    Raises:
        SystemExit: 1 when a second signal stopped the server before its drain finished.
    """
    import uvicorn

    from raymoe.actors.process_tuning import freeze_startup_heap
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.deploy.shutdown import DrainingServer, stop_engine

    stages = tqdm(total=3, desc="raymoe serve", unit="step", bar_format="{desc}: {n}/{total}{postfix} [{elapsed}]")
    if opts.attach is None:  # an attached front end serves the engine's model
        stages.set_postfix_str("demo checkpoint" if opts.model is None else "model folder")
        model = opts.resolved_model(progress=True)
        opts = opts.model_copy(update={"model": model})
        opts.engine_config(model)  # bad options fail here, before anything starts
    stages.update()
    # The engine's step loop runs in a driver actor (its own process), so Ray is started for every topology.
    stages.set_postfix_str(f"Ray ({opts.ray_address or 'local, 127.0.0.1'})")
    import ray

    from raymoe.cluster.bootstrap import init_ray

    started_ray = not ray.is_initialized() and opts.ray_address is None
    init_ray(opts.ray_address)
    stages.update()
    stages.set_postfix_str(f"attach to engine {opts.attach!r}" if opts.attach is not None else
                           f"driver + {opts.world_size} rank(s): load weights, capture graphs")
    try:
        engine = opts.engine_client(progress=True)  # decides the device first: cuda without GPUs fails here
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    stages.update()
    stages.set_postfix_str("ready")
    stages.close()
    server = None
    try:
        app = build_openai_app(engine, api_key=opts.api_key, max_in_flight=opts.max_in_flight, limits=opts.limits,
                               drain=drain, reasoning_parser=opts.reasoning_parser,
                               tool_call_parser=opts.tool_call_parser)
        freeze_startup_heap()  # tokenizer, app and Ray client are built: no full-heap GC pause under the streams
        base_url = f"http://{host}:{port}"
        cfg = engine.config
        how = engine.device_choice.reason if engine.device_choice else f"a front end of engine {opts.attach!r}"
        banner = (f"\nraymoe is serving {engine.model_name!r} at {base_url}/v1 "
                  f"(dp={cfg.parallel.dp_size} tp={cfg.parallel.tp_size} ep={cfg.parallel.ep_size}, {cfg.dtype}, "
                  f"two-batch overlap {'on' if cfg.overlap.enable_tbo else 'off'})\n"
                  f"  {how}\n"
                  f"  try:     {curl_example(base_url, engine.model_name, opts.api_key is not None)}\n"
                  f"  metrics: {base_url}/metrics    health: {base_url}/health    stop: Ctrl-C\n")
        on_ready = (lambda: _demo_request(base_url, engine.model_name, opts.api_key)) if demo_request else None
        from raymoe.deploy.http_protocol import guarded_http_protocol

        # The HTTP parser's protocol with a bounded request head (431 while it arrives) and JSON parse errors.
        http = guarded_http_protocol(opts.limits.max_header_bytes, opts.limits.max_headers,
                                     on_refusal=app.state.serving.metrics.error)
        server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http,
                                               timeout_graceful_shutdown=5), app.state.drain)
        # uvicorn re-raises the signal that stopped it once it has shut down: make SIGTERM, like Ctrl-C, unwind
        # through the ``finally`` below so the ranks and the local Ray are stopped too.
        signal.signal(signal.SIGTERM, _raise_system_exit)
        asyncio.run(_serve(server, base_url, banner, on_ready))
    except KeyboardInterrupt:
        pass
    finally:
        stop_engine(engine, stop_ray=started_ray)
    if server is not None and server.forced:
        raise SystemExit(1)
