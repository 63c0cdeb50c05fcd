"""The world group's rendezvous store, listening only on the rendezvous address.

``dist.init_process_group(init_method="tcp://host:port")`` starts a ``TCPStore`` on rank 0 whose server binds
every interface (``*:port``), whatever ``host`` says: a served dp=2 ep=2 engine on a loopback cluster had rank 0
listening on all addresses of the machine (seen with ``ss -ltn``), where everything else of raymoe listens on
127.0.0.1. :func:`rendezvous_store` binds rank 0's socket to ``host`` itself (the node's address on a real cluster,
127.0.0.1 on a local one) and hands it to the store (``TCPStore(master_listen_fd=...)``, torch's documented way to
give the server a bound socket); the other ranks connect as before.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout: timedelta,
                     listen_sock: socket.socket | None = None) -> dist.TCPStore:
    """The store of a ``tcp://host:port`` rendezvous; rank 0 serves it on ``host`` only.

    Args:
        init_method: ``tcp://host:port`` (IPv4 or bracketed IPv6 address, or a host name).
        rank, world_size: this rank and the world's size. timeout: rendezvous and store-operation timeout.
        listen_sock: rank 0 only: a socket already bound to ``host:port`` and listening (the store takes it
            over). A launcher that binds the port itself and holds it until rank 0 starts leaves no window in
            which another job could take the port and have this job's ranks join its store.
    Raises:
        ValueError: ``init_method`` is not ``tcp://host:port``.
        OSError: rank 0 cannot bind ``host:port`` (taken, or not an address of this machine).
        RuntimeError / DistStoreError: the store could not be reached within ``timeout``.
    """
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"rendezvous must be tcp://host:port, got {init_method!r}")
    host, port = url.hostname, url.port
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    if listen_sock is not None:
        return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                             master_listen_fd=listen_sock.detach())
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(max(128, world_size))
    except OSError:
        sock.close()
        raise
    # detach(): the store owns the descriptor from here on (it closes it when it is destroyed).
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())
