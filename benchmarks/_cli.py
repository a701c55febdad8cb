"""The flags and output every benchmark shares (--smoke, --json as the last line, peak RSS), with no
import beyond the standard library, so a script such as gpu_check.py runs on a machine that has torch
and the training engine but not the federation stack (Flower, SQLAlchemy)."""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
from typing import Any


def peak_rss_mb(*, children: bool = False) -> float:
    """Peak resident set size of this process (or of its waited-for children), in MiB."""
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss / 1024.0  # Linux reports KiB


def report(figures: dict[str, Any], *, as_json: bool) -> None:
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    if as_json:
        print(json.dumps(figures))


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark takes: --smoke and --json. A benchmark
    stopped by SIGTERM (``timeout``, CI) exits through its ``finally`` blocks, so the federations it
    started (SuperLink and SuperNodes in sessions of their own) are stopped too rather than left
    running beside the next measurement."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    out = argparse.ArgumentParser(description=doc.splitlines()[0])
    out.add_argument("--smoke", action="store_true", help="tiny sizes for CI")
    out.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return out
