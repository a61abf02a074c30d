"""The median of several `mnist-ddp bench` results: each ratio and each run's images/s.

    python benchmarks/median_of_runs.py runs/bench-1/bench.json runs/bench-2/bench.json runs/bench-3/bench.json

A ratio is shown with ">" when any of the runs gave only a lower bound for it.
"""

import json
import statistics
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    results = [json.loads(Path(p).read_text()) for p in paths]
    print(f"median of {len(results)} bench runs ({results[0]['dataset']}, {results[0]['environment']['device']})")
    for key, run in results[0]["runs"].items():
        speeds = [r["runs"][key]["images_per_second"] for r in results if key in r["runs"]]
        print(f"  {run['label']:34s} {statistics.median(speeds):10,.0f} images/s   "
              f"(runs: {', '.join(f'{s:,.0f}' for s in speeds)})")
    for key, ratio in results[0]["ratios"].items():
        entries = [r["ratios"][key] for r in results if key in r["ratios"]]
        values = [e["value"] for e in entries if e["value"] is not None]
        if not values:
            print(f"  {ratio['label']:52s} n/a")
            continue
        bound = ">" if any(e["lower_bound"] for e in entries) else ""
        print(f"  {ratio['label']:52s} {bound}{statistics.median(values):.2f}x   "
              f"(runs: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
