"""Summary of a ``raymoe bench compare --rounds N`` run: per-round ratios to the peer, their median and spread.

Why rounds: on a shared or virtual machine, the speed of the same server moves by 15-50 % from one minute to the
next (two single runs of nearly the same code put dp=2 ep=2 at c=16 at 1.36x and 0.95x of vLLM-CPU float32). One
peer run followed by
one raymoe run compares two moments as much as two servers. With rounds, every round serves the peer and each
raymoe topology once, with the order flipped every other round (peer first, then raymoe first), and each raymoe
row is divided by the peer row *of the same round* at the same concurrency. The median of those per-round
ratios is the figure to quote; the min-max range says how far one run can stray from it.

The TPOT goal (TPOT p50 <= 1.5x raymoe's own offline decode step) is also checked round by round, against the
offline step measured in that round (single rank, and in the topology's own rank layout when it has several).
"""

from __future__ import annotations

import statistics

TPOT_GOAL_FACTOR = 1.5
"""Issue 9's serving goal: TPOT p50 at most this many times raymoe's own offline decode step at the same batch."""


def round_ratios(rows: list[dict], peer: str) -> dict[tuple[str, int], float]:
    """``{(server, concurrency): output tok/s over the peer's}`` for every non-peer row of one round's ``rows``
    (dicts with ``server``, ``concurrency``, ``output_throughput``) that has a ``peer`` row at its concurrency."""
    base = {r["concurrency"]: r["output_throughput"] for r in rows if r["server"] == peer}
    return {(r["server"], r["concurrency"]): r["output_throughput"] / base[r["concurrency"]]
            for r in rows if r["server"] != peer and base.get(r["concurrency"])}


def tpot_goal_met(row: dict, step_ms: float, factor: float = TPOT_GOAL_FACTOR) -> bool:
    """Whether ``row``'s TPOT p50 (ms) is within ``factor`` times the offline decode step ``step_ms`` (ms)."""
    return row["median_tpot_ms"] <= factor * step_ms


def summarize_rounds(rounds: list[dict], peer: str, goal_concurrency: int | None = None) -> list[dict]:
    """One summary per (raymoe server, concurrency) over ``rounds``.

    Args:
        rounds: one dict per round, with ``rows`` (as :func:`round_ratios` reads them, plus ``median_tpot_ms``),
            ``offline_decode_step_ms`` (single rank, ms) and ``offline_decode_step_ms_by_topology`` (``{topology:
            ms}`` for the multi-rank layouts; server names are ``"raymoe <topology>"``).
        peer: the row name of the peer the ratios are taken against.
        goal_concurrency: the concurrency the TPOT goal is set at (the offline step's batch); rows at other
            concurrencies get None for the goal counts. None: every row is checked.
    Returns:
        dicts with ``server``, ``concurrency``, ``ratios`` (per round, in round order), ``median_ratio``,
        ``median_tok_s``, ``tpot_goal_met`` and ``tpot_goal_met_own_layout`` (rounds meeting the TPOT goal against
        the single-rank step and against the topology's own layout step; the latter is None for one rank) and
        ``rounds``.
    Raises:
        ValueError: no rounds.
    """
    if not rounds:
        raise ValueError("no rounds to summarize")
    keys = list(dict.fromkeys((r["server"], r["concurrency"]) for rd in rounds for r in rd["rows"]
                              if r["server"] != peer))
    ratios_by_round = [round_ratios(rd["rows"], peer) for rd in rounds]
    out = []
    for server, conc in keys:
        ratios, tok_s, met, met_own, own_known = [], [], 0, 0, False
        for rd, round_ratio in zip(rounds, ratios_by_round, strict=True):
            row = next((r for r in rd["rows"] if r["server"] == server and r["concurrency"] == conc), None)
            if row is None:
                continue
            tok_s.append(row["output_throughput"])
            ratio = round_ratio.get((server, conc))
            if ratio is not None:
                ratios.append(ratio)
            met += tpot_goal_met(row, rd["offline_decode_step_ms"])
            own = rd.get("offline_decode_step_ms_by_topology", {}).get(server.removeprefix("raymoe ").strip())
            if own is not None:
                own_known = True
                met_own += tpot_goal_met(row, own)
        goal = goal_concurrency is None or conc == goal_concurrency
        out.append({"server": server, "concurrency": conc, "ratios": ratios,
                    "median_ratio": statistics.median(ratios) if ratios else None,
                    "median_tok_s": statistics.median(tok_s), "tpot_goal_met": met if goal else None,
                    "tpot_goal_met_own_layout": met_own if goal and own_known else None, "rounds": len(tok_s)})
    return out


def rounds_table(summary: list[dict], peer: str) -> str:
    """Fixed-width text of :func:`summarize_rounds`' output: median tok/s, median ratio to ``peer`` with the
    per-round ratios, and in how many rounds the TPOT goal held ("-" where the row is not at the goal's
    concurrency)."""
    lines = [f"ratios to {peer}, round by round (each raymoe row over the peer row of the same round)",
             f"{'server':<26}{'conc':>5}{'median tok/s':>14}{'median ratio':>14}  {'per round':<28}"
             f"{'TPOT goal met':>14}"]
    for s in summary:
        ratio = f"{s['median_ratio']:.2f}x" if s["median_ratio"] is not None else "-"
        per = " ".join(f"{x:.2f}" for x in s["ratios"]) or "-"
        goal = f"{s['tpot_goal_met']}/{s['rounds']}" if s["tpot_goal_met"] is not None else "-"
        if s["tpot_goal_met_own_layout"] is not None:
            goal += f" (own {s['tpot_goal_met_own_layout']}/{s['rounds']})"
        lines.append(f"{s['server']:<26}{s['concurrency']:>5}{s['median_tok_s']:>14.0f}{ratio:>14}  {per:<28}"
                     f"{goal:>14}")
    return "\n".join(lines)
