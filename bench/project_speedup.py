#!/usr/bin/env python3
"""What each speculative route would give on a larger model, from two measurements.

Random-weight models of real size measure speed exactly (speed does not depend on weight values) but cannot
draft: their text is noise. A real small model drafts for real but its verify costs are its own. This script
combines the two:

- from a `verity bench speed --json` record of the small model (routes side by side): per route and category,
  tokens per cycle T = completion tokens / cycles, verify rows per cycle W = verify_rows / cycles, and the
  drafting time per cycle as a share of the small model's one-row forward, d = (draft_s / cycles) / ms_small(1);
- from `verity bench rowcost --json` records: ms_small(W) for the small model, ms_big(W) for the large one
  (linear between the measured widths, and past the widest along its last segment).

A route then costs ms_big(W) + d · ms_big(1) per cycle on the large model and yields T tokens, against
ms_big(1) per token for AR, so the expected speed-up is T · ms_big(1) / (ms_big(W) + d · ms_big(1)). Taking the
draft's share of a forward as fixed suits the MTP head (one layer and the output projection of either model)
and copy (host work, d ≈ 0); a drafter model's share shrinks as the target grows, so its projection is
conservative. The acceptance is the small model's: the large model's own acceptance is unknown until it drafts.

    python3 bench/project_speedup.py --routes SMALL_SPEED.json --small-rowcost SMALL_ROWCOST.json \\
        --big-rowcost BIG_ROWCOST.json [--key KEY]

A rowcost file holding several runs under keys (as the committed records do) takes `--key` for each: KEY or
SMALL_KEY,BIG_KEY.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def widths(path: str, key: str | None) -> list[tuple[int, float]]:
    data = json.load(open(path))
    if "widths" not in data:
        if key is None:
            sys.exit(f"{path} holds several runs ({', '.join(data)}): name one with --key")
        data = data[key]
    return sorted((w["w"], w["median_ms"]) for w in data["widths"])


def at(curve: list[tuple[int, float]], w: float) -> float:
    """ms at width w: linear between measured widths, along the last segment beyond the widest."""
    if w <= curve[0][0]:
        return curve[0][1]
    for (w0, m0), (w1, m1) in zip(curve, curve[1:]):
        if w <= w1:
            return m0 + (m1 - m0) * (w - w0) / (w1 - w0)
    (w0, m0), (w1, m1) = curve[-2], curve[-1]
    return m1 + (m1 - m0) * (w - w1) / (w1 - w0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routes", required=True, help="the small model's `bench speed --json` record")
    ap.add_argument("--small-rowcost", required=True)
    ap.add_argument("--big-rowcost", required=True)
    ap.add_argument("--key", help="run key(s) inside keyed rowcost files: KEY or SMALL_KEY,BIG_KEY")
    args = ap.parse_args()
    keys = args.key.split(",", 1) if args.key and "," in args.key else [args.key, args.key]
    small, big = widths(args.small_rowcost, keys[0] or None), widths(args.big_rowcost, keys[1] or None)
    records = json.load(open(args.routes))
    if not any(r.get("verify_rows") for r in records if r["route"] != "ar"):
        sys.exit(f"{args.routes} has no verify_rows: record it with a verity whose bench writes the field")
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for r in records:
        for cat in (r["category"], "all"):
            s = sums[(r["route"], cat)]
            s[0] += r["completion_tokens"]
            s[1] += r["cycles"]
            s[2] += r["verify_rows"] or r["cycles"]
            s[3] += r["draft_s"]
    one_small, one_big = at(small, 1), at(big, 1)
    print(f"ms(1): small {one_small:.3f}, large {one_big:.3f}; large ms(8)/ms(1) {at(big, 8) / one_big:.3f}")
    print(f"{'route':<12} {'category':<12} {'tok/cycle':>9} {'rows/cycle':>10} {'draft share':>11} {'speed-up':>9}")
    for (route, cat), (tokens, cycles, rows, draft_s) in sorted(sums.items()):
        if route == "ar" or cycles == 0:
            continue
        t, w = tokens / cycles, rows / cycles
        d = draft_s / cycles * 1e3 / one_small
        speedup = t * one_big / (at(big, w) + d * one_big)
        print(f"{route:<12} {cat:<12} {t:>9.2f} {w:>10.2f} {d:>11.3f} {speedup:>8.2f}x")


if __name__ == "__main__":
    main()
