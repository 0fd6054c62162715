"""Write the two small workload files shipped in benchmarks/traces/ (see README.md there for
their provenance): a Mooncake-format trace whose requests share hash ids the way conversation
sessions do, and an Azure-LLM-inference-format conversation trace.

Both are synthetic. Only the formats and the shapes described below come from the public
traces; the lengths are scaled down so that a 135M model on 2 CPU cores replays each file in
seconds. Deterministic: the same seed writes the same bytes.

    python benchmarks/traces/make_traces.py [--seed 0] [--out benchmarks/traces]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
from datetime import datetime, timedelta
from pathlib import Path

BLOCK = 512  # Mooncake's hash_ids name blocks of 512 tokens


def mooncake_style(rng: random.Random, sessions: int = 8, turns: int = 3) -> list[dict]:
    """Sessions of `turns` requests. Every prompt starts with hash id 0 (a system prompt all
    requests share, as in the first lines of Mooncake's published trace); a session's first turn
    adds one block of its own; each later turn repeats the previous turn's full blocks (its
    history: prompt and answer) and adds a block, so a session's prefix grows turn by turn. A
    turn's last block is partly filled: its hash id is not shared. Sessions start as a Poisson
    process; turns follow 4-8 s apart; timestamps are whole ms and some requests share one."""
    rows, next_id = [], 1
    t = 0.0
    for _ in range(sessions):
        ids, at = [0], t
        for _ in range(turns):
            ids = ids + [next_id]
            next_id += 1
            length = BLOCK * (len(ids) - 1) + rng.randint(96, BLOCK)  # the last block partly filled
            out = max(4, min(96, round(rng.lognormvariate(math.log(28), 0.5))))
            rows.append({"timestamp": int(at * 1000), "input_length": length, "output_length": out,
                         "hash_ids": list(ids)})
            # The next turn's history: this prompt's full blocks; the partial one is re-hashed.
            ids = ids[:-1] + [next_id]
            next_id += 1
            at += rng.uniform(4.0, 8.0)
        t += rng.expovariate(1 / 2.5)
    rows.sort(key=lambda r: r["timestamp"])
    # Two requests at the same instant, as the published trace has many.
    rows[3]["timestamp"] = rows[2]["timestamp"]
    return rows


def azure_style(rng: random.Random, n: int = 32) -> list[tuple[str, int, int]]:
    """Rows of (TIMESTAMP, ContextTokens, GeneratedTokens). Lengths log-normal around the
    conversation trace's medians as the Splitwise paper reports them (prompt ~1020, output
    ~129 tokens), divided by 4; arrivals in bursts (gamma gaps of CV 2) as that trace's are."""
    start = datetime(2023, 11, 16, 18, 0, 0)
    t, rows = 0.0, []
    for _ in range(n):
        prompt = max(8, min(1536, round(rng.lognormvariate(math.log(1020 / 4), 0.7))))
        out = max(2, min(160, round(rng.lognormvariate(math.log(129 / 4), 0.8))))
        stamp = start + timedelta(seconds=t)
        rows.append((stamp.strftime("%Y-%m-%d %H:%M:%S.%f") + "0", prompt, out))  # 7 digits, as the files have
        t += rng.gammavariate(0.25, 4.0 * 0.5)  # shape 1/CV^2, mean 0.5 s
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = p.parse_args()
    out = Path(args.out)
    rng = random.Random(args.seed)
    with open(out / "mooncake_style.jsonl", "w") as f:
        for row in mooncake_style(rng):
            f.write(json.dumps(row) + "\n")
    with open(out / "azure_conv_style.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        w.writerows(azure_style(rng))
    print(f"wrote {out / 'mooncake_style.jsonl'} and {out / 'azure_conv_style.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
