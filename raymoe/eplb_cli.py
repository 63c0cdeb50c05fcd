"""``raymoe eplb dump``: the expert load a running server recorded, written to a file that ``init_expert_location``
accepts (``raymoe.eplb.initial`` computes a placement from its ``expert_load``).

It asks the server's ``GET /admin/expert_load`` (``raymoe.deploy.admin``) over HTTP, so it works against
``raymoe serve`` and the Ray Serve app alike, and needs nothing of the engine but its URL (and API key).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from raymoe.errors import RaymoeError

EXPERT_LOAD_ROUTE = "/admin/expert_load"


class EplbDumpError(RaymoeError):
    """The server could not be reached, records no expert load, or answered something that is not a load record
    (``raymoe eplb dump`` prints the message and exits with status 2)."""


def _error_message(response) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the start of the body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _check_record(data) -> None:
    """Raise unless ``data`` is a load record: ``expert_load`` a non-empty [layers][experts] of integers >= 0."""
    load = data.get("expert_load") if isinstance(data, dict) else None
    if not isinstance(load, list) or not load or not all(isinstance(row, list) for row in load):
        raise EplbDumpError("the server's answer holds no expert_load [layers][experts]")
    if len({len(row) for row in load}) != 1 or not all(isinstance(x, int) and x >= 0 for row in load for x in row):
        raise EplbDumpError("the server's expert_load is not a [layers][experts] table of counts")


def fetch_expert_load(url: str, api_key: str | None = None, timeout_s: float = 30.0) -> dict:
    """The load record of the server at ``url`` (``GET /admin/expert_load``; the body of
    ``ExpertLoadReport.to_json``).

    Raises:
        EplbDumpError: the server cannot be reached, answers an error (404: it records no expert load, the
            option is named; 401: the API key), or its answer is not a load record.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    target = url.rstrip("/") + EXPERT_LOAD_ROUTE
    try:
        response = httpx.get(target, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise EplbDumpError(f"cannot reach the server at {url} ({type(e).__name__}: {e})") from None
    if response.status_code == 404:
        raise EplbDumpError(f"{target} answered 404: {_error_message(response)}")
    if response.status_code != 200:
        raise EplbDumpError(f"{target} answered {response.status_code}: {_error_message(response)}")
    try:
        data = response.json()
    except ValueError:
        raise EplbDumpError(f"{target} answered something that is not JSON") from None
    _check_record(data)
    return data


def _cmd_dump(a: argparse.Namespace) -> None:
    data = fetch_expert_load(a.url, a.api_key or os.environ.get("RAYMOE_API_KEY"))
    out = Path(a.out)
    try:
        out.write_text(json.dumps(data) + "\n")
    except OSError as e:
        raise EplbDumpError(f"cannot write {out}: {e}") from None
    layers, experts = len(data["expert_load"]), len(data["expert_load"][0])
    print(f"wrote {out}: expert load of {layers} MoE layers x {experts} experts over {data.get('window_steps')} "
          f"steps (use it as --init-expert-location)")


def add_eplb_parser(sub) -> None:
    """Register ``raymoe eplb`` (``dump``) on the top-level subparsers ``sub``."""
    p = sub.add_parser("eplb", help="expert-parallel load balancing tools (dump the recorded expert load)")
    eplb = p.add_subparsers(dest="eplb_cmd", required=True)
    d = eplb.add_parser("dump", help="write a running server's recorded expert load (GET /admin/expert_load) to a "
                                     "file that --init-expert-location accepts",
                        description="Write the expert load a running raymoe server recorded (it must run with "
                                    "--enable-expert-distribution-metrics or --enable-eplb) to FILE: the JSON of "
                                    "GET /admin/expert_load, which --init-expert-location turns into a placement.")
    d.add_argument("--out", required=True, metavar="FILE", help="where to write the JSON")
    d.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    d.add_argument("--api-key", default=None, help="the server's API key (or $RAYMOE_API_KEY)")
    d.set_defaults(func=_cmd_dump)
