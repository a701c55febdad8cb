"""Server aggregation speed: weighted mean of many updates vs a plain copy of the same bytes.

The server folds each update into running float64 sums as it arrives (``WeightedMean``), checking
names, shapes and finiteness first. This measures that against the cheapest thing that touches the
same bytes: copying every update once (``np.copyto``). ``fraction_of_copy_bandwidth`` = copy_s /
mean_s (1.0 would be as fast as a memcpy).

    python benchmarks/aggregate_throughput.py            # 100 updates x 1M float32
    python benchmarks/aggregate_throughput.py --smoke    # tiny, for CI
    python benchmarks/aggregate_throughput.py --json     # last line: one JSON object
"""

from __future__ import annotations

import time

import numpy as np

from _common import parser as make_parser
from _common import peak_rss_mb, report
from quorumfl.aggregation import NodeUpdate, WeightedMean


def main() -> None:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    nodes, params = (10, 10_000) if args.smoke else (args.nodes, args.params)

    rng = np.random.default_rng(0)
    # Two tensors per update, like a layer's weight and bias.
    split = params - params // 1000
    updates = [
        NodeUpdate(str(i), {"w": rng.standard_normal(split, dtype=np.float32),
                            "b": rng.standard_normal(params - split, dtype=np.float32)}, float(rng.integers(50, 500)))
        for i in range(nodes)
    ]
    template = updates[0].arrays

    mean_times, copy_times = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        mean = WeightedMean(template)
        for update in updates:
            mean.add(update)
        result = mean.result()
        mean_times.append(time.perf_counter() - start)

        sink = {k: np.empty_like(v) for k, v in template.items()}
        start = time.perf_counter()
        for update in updates:
            for key, value in update.arrays.items():
                np.copyto(sink[key], value)
        copy_times.append(time.perf_counter() - start)

    # Correctness against a plain numpy reference, so a fast wrong answer cannot pass.
    total = sum(u.weight for u in updates)
    reference = np.zeros(split)
    for update in updates:
        reference += update.weight / total * update.arrays["w"].astype(np.float64)
    np.testing.assert_allclose(result["w"], reference, rtol=1e-5, atol=1e-6)

    mean_s, copy_s = min(mean_times), min(copy_times)
    report(
        {
            "nodes": nodes,
            "params": params,
            "update_bytes_total": nodes * params * 4,
            "mean_s": mean_s,
            "copy_s": copy_s,
            "fraction_of_copy_bandwidth": copy_s / mean_s,
            "peak_rss_mb": peak_rss_mb(),
        },
        as_json=args.json,
    )


if __name__ == "__main__":
    main()
