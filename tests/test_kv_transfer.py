"""KV rows between two processes' pools (``raymoe.kvcache.kv_transfer``), through NIXL (UCX on loopback) and
through the gloo fallback: the same scenarios on both backends, each side a process of its own with its own
pool, metadata passed by the test as the driver actors would.

Checked: the rows of scattered source slots land in the chosen destination slots of every buffer and nothing
else changes (MHA pool: key and value per layer; MLA pool: latent rows); several transfers in a row keep their
tags apart; a receive whose send never comes raises ``KVTransferError`` within its bound (no hang); pools that
differ (a TP size or dtype apart) are refused when the peer is added, naming the difference; slots that are not
pages in order are refused (a partial last page moves whole).
"""

from __future__ import annotations

import time

import pytest
import torch

from raymoe.bench.kv_transfer import run_pair
from raymoe.kvcache.kv_layout import KVLayout, KVLayoutMismatch
from raymoe.kvcache.kv_transfer import GlooKVTransfer, KVTransferError, active_kv_backend, nixl_available
from raymoe.kvcache.mla_pool import MLATokenToKVPool
from raymoe.kvcache.pools import TokenToKVPool

SLOTS = 64
SRC = [3, 4, 5, 6, 20, 41, 42, 63]
DST = [10, 11, 12, 13, 1, 30, 31, 2]


def _pools(seed: int):
    g = torch.Generator().manual_seed(seed)
    mha = TokenToKVPool(SLOTS, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    mla = MLATokenToKVPool(SLOTS, num_layers=2, kv_lora_rank=16, qk_rope_head_dim=8, dtype=torch.bfloat16)
    for b in [*mha.k_buffer, *mha.v_buffer, *mla.kv_buffer]:
        b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return mha, mla


def _side(role: str, backend: str, conn, results) -> None:
    """One process: build pools, an agent per pool, then send (role "send") or receive and check."""
    from raymoe.kvcache.kv_transfer import make_kv_transfer

    mha, mla = _pools(1 if role == "send" else 2)
    before = [b.clone() for b in KVLayout.of_pool(mha).buffers + KVLayout.of_pool(mla).buffers]
    agents = [make_kv_transfer(f"{role}-{kind}", KVLayout.of_pool(pool), backend)
              for kind, pool in (("mha", mha), ("mla", mla))]
    if role == "send":  # one side at a time: metadata can exceed a pipe's buffer
        conn.send([a.metadata() for a in agents])
        peers = [a.add_peer(m) for a, m in zip(agents, conn.recv(), strict=True)]
    else:
        peers = [a.add_peer(m) for a, m in zip(agents, conn.recv(), strict=True)]
        conn.send([a.metadata() for a in agents])
    for round_ in range(2):  # the second round reuses the connections; tags keep the transfers apart
        for a, peer in zip(agents, peers, strict=True):
            tag = f"{round_}-{a.name}"
            if role == "send":
                a.send(peer, SRC, DST, tag.replace("send", "recv"), timeout_s=30)
            else:
                a.receive(peer, DST, tag, timeout_s=30)
    if role == "recv":
        src_mha, src_mla = _pools(1)
        src = KVLayout.of_pool(src_mha).buffers + KVLayout.of_pool(src_mla).buffers
        now = KVLayout.of_pool(mha).buffers + KVLayout.of_pool(mla).buffers
        moved = all(torch.equal(n[DST], s[SRC]) for n, s in zip(now, src, strict=True))
        keep = [i for i in range(SLOTS + 1) if i not in DST]
        untouched = all(torch.equal(n[keep], b[keep]) for n, b in zip(now, before, strict=True))
        t0 = time.monotonic()
        try:
            agents[0].receive(peers[0], DST, "never-sent", timeout_s=0.5)
            timed_out = None
        except KVTransferError as e:
            timed_out = (time.monotonic() - t0, str(e))
        results.put({"moved": moved, "untouched": untouched, "timed_out": timed_out})
    conn.send("done")
    conn.recv()  # hold the agents until both sides are done
    for a in agents:
        a.close()


@pytest.mark.parametrize("backend", ["nixl", "gloo"])
def test_rows_move_between_processes_and_a_missing_send_times_out(backend):
    if backend == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed (pip install nixl-cu12)")
    out = run_pair(_side, (backend,), 120)  # the sides' metadata crosses their pipe (the driver actors' part)
    assert out["moved"] and out["untouched"], out
    waited, message = out["timed_out"]
    assert 0.5 <= waited < 5.0 and "never-sent" in message and "0.5 s" in message


def test_pools_that_differ_are_refused_when_the_peer_is_added():
    mha, _ = _pools(1)
    other = TokenToKVPool(SLOTS, num_layers=3, num_kv_heads=1, head_dim=8, dtype=torch.float32)  # tp 2x wider
    here = GlooKVTransfer("here", KVLayout.of_pool(mha))
    there = GlooKVTransfer("there", KVLayout.of_pool(other))
    with pytest.raises(KVLayoutMismatch, match="same TP size"):
        here.add_peer(there.metadata())
    half = GlooKVTransfer("half", KVLayout.of_pool(TokenToKVPool(SLOTS, 3, 2, 8, dtype=torch.bfloat16)))
    with pytest.raises(KVLayoutMismatch, match="bfloat16"):
        here.add_peer(half.metadata())
    fewer = GlooKVTransfer("fewer", KVLayout.of_pool(TokenToKVPool(SLOTS, 2, 2, 8, dtype=torch.float32)))
    with pytest.raises(KVLayoutMismatch, match="in number"):
        here.add_peer(fewer.metadata())


def test_slots_must_be_pages_in_order_and_the_backend_is_reported():
    pool = TokenToKVPool(63, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)  # 64 rows: 4 pages
    layout = KVLayout.of_pool(pool, page_tokens=16)
    assert layout.page_indices(list(range(16, 48))) == [1, 2, 5, 6]  # pages 1, 2 of the key and value buffers
    assert layout.page_indices(list(range(16, 37))) == [1, 2, 5, 6]  # page 2 partial: it moves whole
    with pytest.raises(ValueError, match="pages of 16"):
        layout.page_indices(list(range(8, 24)))  # starts mid-page
    with pytest.raises(ValueError, match="pages of 16"):
        layout.page_indices([16, 18] + list(range(18, 32)))
    with pytest.raises(ValueError, match="pages of 16"):
        layout.page_indices(list(range(16, 31)) + [48, 49])  # a partial page before the last
    with pytest.raises(ValueError, match="whole pages"):
        KVLayout.of_pool(TokenToKVPool(62, 1, 1, 4, dtype=torch.float32), page_tokens=16)
    assert active_kv_backend("auto") == ("nixl" if nixl_available() else "gloo")
    with pytest.raises(ValueError, match="backend"):
        active_kv_backend("rdma")
