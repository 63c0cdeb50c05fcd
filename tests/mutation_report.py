"""Per-file mutation scores of the last ``mutmut run`` (``make mutation``), with the recorded equivalent mutants.

Reads mutmut's results under ``mutants/`` and ``tests/mutation_equivalents.txt``, prints one row per mutated file
(``--markdown``: as a Markdown table) and exits non-zero when a file scores below ``--min-score`` or an entry of the
equivalents file is stale. Run from the repository root, after ``mutmut run``.

Score = (killed + timeout) / (mutants - equivalent). Survivors and mutants no test reaches count against it.

An entry of the equivalents file is ``<mutant name> | <the mutated line, as mutmut shows it> | <why>``; the line is
checked against the mutant, so an entry whose mutant was renumbered by a change to its function fails loudly
instead of excusing another mutant. An entry whose mutant is now killed is stale too (delete it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

EQUIVALENTS = Path("tests/mutation_equivalents.txt")
DETECTED = {"killed", "timeout"}


def load_equivalents(path: Path) -> dict[str, tuple[str, str]]:
    """``{mutant name: (mutated line, reason)}`` from the equivalents file (``#`` starts a comment line)."""
    out: dict[str, tuple[str, str]] = {}
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]
        if len(parts) != 3 or not all(parts):
            raise SystemExit(f"{path}:{n}: expected '<mutant> | <mutated line> | <reason>', got {raw!r}")
        if parts[0] in out:
            raise SystemExit(f"{path}:{n}: {parts[0]} is listed twice")
        out[parts[0]] = (parts[1], parts[2])
    return out


def mutated_lines(name: str, path: str) -> list[str]:
    """The added lines of a mutant's diff, stripped (mutmut's own diff)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    diff = get_diff_for_mutant(name, path=path).splitlines()[2:]
    return [line[1:].strip() for line in diff if line.startswith("+")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-score", type=float, default=90.0, help="least score per file, percent")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args()

    from mutmut.stats import status_by_exit_code

    equivalents = load_equivalents(EQUIVALENTS)
    metas = sorted(Path("mutants").rglob("*.py.meta"))
    if not metas:
        print("no mutmut results under mutants/: run `mutmut run` first", file=sys.stderr)
        return 2
    errors: list[str] = []  # stale equivalents, files below the least score: the run fails
    survivors: list[str] = []  # neither killed nor recorded as equivalent: listed, they only lower the score
    seen: set[str] = set()
    rows = []
    for meta in metas:
        path = str(meta.relative_to("mutants"))[: -len(".meta")]
        exit_codes = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
        counts: Counter[str] = Counter()
        for name, code in exit_codes.items():
            status = status_by_exit_code[code]
            if name in equivalents:
                seen.add(name)
                line, _ = equivalents[name]
                if status in DETECTED:
                    errors.append(f"{name} is listed as equivalent but was {status}: delete its entry")
                elif line not in mutated_lines(name, path):
                    errors.append(f"{name} no longer mutates `{line}` (renumbered?): "
                                  f"it now adds {mutated_lines(name, path)}")
                else:
                    status = "equivalent"
            counts[status] += 1
            if status not in DETECTED | {"equivalent"}:
                survivors.append(f"{status}: {name} (`mutmut show {name}`)")
        total = sum(counts.values())
        detected = counts["killed"] + counts["timeout"]
        score = 100.0 * detected / max(total - counts["equivalent"], 1)
        rows.append((path, total, detected, counts["equivalent"], total - detected - counts["equivalent"], score))
        if score < args.min_score:
            errors.append(f"{path}: score {score:.1f} % is below {args.min_score:.0f} %")
    errors += [f"{name} is listed as equivalent but is no mutant of this run" for name in equivalents
               if name not in seen]

    header = ("file", "mutants", "killed", "equivalent", "survived", "score")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join(["---"] + ["---:"] * 5) + "|")
        for path, total, detected, equiv, alive, score in rows:
            print(f"| `{path}` | {total} | {detected} | {equiv} | {alive} | {score:.1f} % |")
    else:
        print(f"{header[0]:<40} {header[1]:>8} {header[2]:>7} {header[3]:>11} {header[4]:>9} {header[5]:>8}")
        for path, total, detected, equiv, alive, score in rows:
            print(f"{path:<40} {total:>8} {detected:>7} {equiv:>11} {alive:>9} {score:>7.1f}%")
    for line in survivors + errors:
        print(line, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
