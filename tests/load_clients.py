"""Clients for the front end's load checks: ``python tests/load_clients.py URL KEY SECONDS ATTACKERS``.

It streams a canary completion (``max_tokens`` 1500) and probes ``/health`` every 50 ms while ``ATTACKERS`` clients
send the report's 15 MB chat body (142 messages of 4,096 text parts) as fast as the server answers, for
``SECONDS``; it prints one JSON object: the canary's gaps between chunks (seconds, largest first), the probes'
latencies (largest first), the attack answers' status codes, and the machine's scheduling delay over the same
time: the largest oversleep of an idle process that sleeps 10 ms at a time (on a shared, overloaded machine a
process waits for a CPU for up to seconds, which no server can prevent).

The measuring clients and the attackers each run in a process of their own, apart from the server they measure:
threads that push 15 MB through ``sendall`` take the GIL back after every ``send``, and a reader thread in the
same interpreter then waits for it long enough to report gaps of a second that the server never made.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import httpx


def attack_body() -> bytes:
    """142 messages of 4,096 text parts: about 15 MB, refused in the end."""
    part = {"type": "text", "text": "x"}
    return json.dumps({"model": "fake", "messages": [{"role": "user", "content": [part] * 4096}] * 142},
                      separators=(",", ":")).encode()


def _attacker(url: str, key: str, body: bytes, stop: threading.Event, statuses: list[int]) -> None:
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    while not stop.is_set():
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head)
            sock.sendall(body)
            statuses.append(int(sock.makefile("rb").readline().split()[1]))


def _health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(f"{url}/health").raise_for_status()
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)


def attack(url: str, key: str, seconds: float, attackers: int) -> list[int]:
    """Send the attack body from ``attackers`` threads for ``seconds``; the answers' status codes."""
    body = attack_body()
    stop = threading.Event()
    statuses: list[int] = []
    threads = [threading.Thread(target=_attacker, args=(url, key, body, stop, statuses)) for _ in range(attackers)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return statuses


def oversleep(seconds: float, step_s: float = 0.01) -> float:
    """The largest delay past ``step_s`` of ``time.sleep(step_s)`` over ``seconds`` (seconds)."""
    worst, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        time.sleep(step_s)
        worst = max(worst, time.perf_counter() - t0 - step_s)
    return worst


def run(url: str, key: str, seconds: float, attackers: int) -> dict:
    """Measure the canary and the probes while an attacking process runs (see the module docstring)."""
    import subprocess

    stop = threading.Event()
    health: list[float] = []
    gaps: list[float] = []
    threads = [threading.Thread(target=_health, args=(url, stop, health))]
    request = {"model": "fake", "prompt": "x", "max_tokens": 1500, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=request,
                                                 headers={"Authorization": f"Bearer {key}"}) as canary:
        lines = canary.iter_lines()
        next(lines)  # the stream runs: start the load
        attacking = subprocess.Popen([sys.executable, __file__, "attack", url, key, str(seconds), str(attackers)],
                                     stdout=subprocess.PIPE, text=True)
        ticking = subprocess.Popen([sys.executable, __file__, "tick", str(seconds)], stdout=subprocess.PIPE, text=True)
        for t in threads:
            t.start()
        started = last = time.perf_counter()
        for line in lines:
            now = time.perf_counter()
            if line:
                gaps.append(now - last)
                last = now
            if now - started > seconds:
                break
        stop.set()
    for t in threads:
        t.join(timeout=120)
    statuses = json.loads(attacking.communicate(timeout=180)[0])
    noise = json.loads(ticking.communicate(timeout=180)[0])
    return {"gaps": sorted(gaps, reverse=True), "health": sorted(health, reverse=True), "statuses": statuses,
            "machine_delay": noise}


if __name__ == "__main__":
    if sys.argv[1] == "attack":
        print(json.dumps(attack(sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]))))
    elif sys.argv[1] == "tick":
        print(json.dumps(oversleep(float(sys.argv[2]))))
    else:
        print(json.dumps(run(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))))
