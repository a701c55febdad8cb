"""Checking and importing a department's large table: throughput and peak memory of `quorumfl data`.

For each size, a CSV of property sales (parcel, area, year built, zone, district, sale price) is
written in a temporary folder, then ``quorumfl data check`` and ``quorumfl data import`` run on it as
fresh processes, each the only child of a small probe that reports its peak RSS. Reported per
size: the file's MB and rows, each command's seconds, MB/s of the file and peak RSS in MB, and the
partition's size on disk. The issue's keys: ``check_mb_s_<size>``, ``import_mb_s_<size>``,
``check_peak_rss_mb_<size>``, ``import_peak_rss_mb_<size>`` for 200mb and 2gb.

    python benchmarks/big_import.py            # 200 MB and 2 GB
    python benchmarks/big_import.py --smoke    # 5 MB, for CI
    python benchmarks/big_import.py --json     # last line: one JSON object
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _cli import parser as make_parser
from _cli import report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's test data helpers
from tests.core.city_data import write_sales_csv  # noqa: E402

SCHEMA = {"task": "tabular", "version": "1", "label": "sale_price", "objective": "regression",
          "target_range": [0, 1_000_000], "numeric": [{"name": "area", "low": 0, "high": 1000},
                                                      {"name": "year_built", "low": 0, "high": 10000}],
          "categorical": [{"name": "zone", "buckets": 16}, {"name": "district", "buckets": 16}], "ignore": ["parcel"]}
PROBE = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024); sys.exit(done.returncode)")


def _command(*argv: str) -> tuple[float, float]:
    """Seconds and peak RSS (MB) of one ``quorumfl`` process."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, sys.executable, "-m", "quorumfl.cli", *argv],
                          capture_output=True, text=True, check=True)
    return time.perf_counter() - began, float(done.stdout.strip().splitlines()[-1])


def _size(label: str, size: int, folder: Path) -> dict[str, float]:
    source, schema = folder / f"sales-{label}.csv", folder / "schema.json"
    rows = write_sales_csv(source, size)
    schema.write_text(json.dumps(SCHEMA))
    mb = source.stat().st_size / 1e6
    check_s, check_rss = _command("data", "check", str(source), "--schema", str(schema))
    out = folder / f"part-{label}"
    import_s, import_rss = _command("data", "import", str(source), "--schema", str(schema), "--department", "tax",
                                    "--out", str(out))
    partition = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    source.unlink()
    return {f"file_mb_{label}": mb, f"rows_{label}": rows, f"check_s_{label}": check_s,
            f"check_mb_s_{label}": mb / check_s, f"check_peak_rss_mb_{label}": check_rss,
            f"import_s_{label}": import_s, f"import_mb_s_{label}": mb / import_s,
            f"import_peak_rss_mb_{label}": import_rss, f"partition_mb_{label}": partition}


def main() -> None:
    args = make_parser(__doc__ or "").parse_args()
    sizes = {"5mb": 5 * 10**6} if args.smoke else {"200mb": 200 * 10**6, "2gb": 2 * 10**9}
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="quorumfl-bench-import-") as tmp:
        for label, size in sizes.items():
            figures.update(_size(label, size, Path(tmp)))
    report(figures, as_json=args.json)


if __name__ == "__main__":
    main()
