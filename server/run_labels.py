"""What a stored run is, in words: its privacy (secure-aggregation mode, threshold, DP) and its task
(what is learned, from which schema, with which model).

Every output that describes a run (``runs start``, ``runs show``, ``runs list``, the report, the
metrics endpoint) takes these words from here, so they say the same thing. The functions read the
run's stored config (kebab-case keys, as ``RunConfig.resolved`` writes them) and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PLAINTEXT", "privacy_view", "task_label"]

PLAINTEXT = "plaintext"
MAX_SCHEMA_BYTES = 2**20
MODES = {"masking": "masked", "ckks": "ckks", "none": PLAINTEXT}


def _threshold(value: Any, mode: str) -> str:
    t = float(value)
    who = "each round's nodes" if mode == "masking" else "the key ceremony's nodes"
    return f"{t:.0f} nodes" if t > 1 else f"{t:.0%} of {who}"


def _dp(config: Mapping[str, Any]) -> str:
    dp = str(config.get("dp", "none"))
    if dp == "none":
        return "no DP"
    epsilon, sigma = float(config.get("dp-epsilon", 0.0)), float(config.get("dp-noise-multiplier", 0.0))
    budget = f"ε {epsilon:g} per department" if epsilon > 0 else f"noise multiplier {sigma:g}"
    return f"DP {dp} ({budget})"


def privacy_view(config: Mapping[str, Any]) -> dict[str, str]:
    """``mode`` (masked, ckks, plaintext), ``dp`` (none, local, distributed), ``threshold`` (empty for
    plaintext), a short ``label`` for tables and a ``sentence`` for headers and reports."""
    secure = str(config.get("secure-aggregation", "none"))
    mode = MODES.get(secure, secure)
    dp = str(config.get("dp", "none"))
    threshold = _threshold(config.get("secagg-threshold", 0.6), secure) if secure != "none" else ""
    label = mode + ("+dp" if dp != "none" else "")
    if secure == "none":
        sentence = f"plaintext: the server sees each department's update; {_dp(config)}"
    elif secure == "masking":
        sentence = f"masked: the server learns only sums of at least t = {threshold}; {_dp(config)}"
    else:
        sentence = f"threshold CKKS: any t = {threshold} decrypt only the sum; {_dp(config)}"
    return {"mode": mode, "dp": dp, "threshold": threshold, "label": label, "sentence": sentence}


def _schema(config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's schema: inline JSON (what ``runs start`` sends), or the file on the server it names."""
    text = str(config.get("task-schema", "") or "")
    try:
        if text and not text.lstrip().startswith("{"):
            with open(Path(text).expanduser(), encoding="utf-8") as f:
                text = f.read(MAX_SCHEMA_BYTES)
        schema = json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}  # a file gone since: the label says the task alone
    return schema if isinstance(schema, dict) else {}


def task_label(config: Mapping[str, Any]) -> str:
    """What the run learns, as the schema says: e.g. ``tabular regression of 'price' (mlp)``,
    ``text classification of 'department' from 'request' (fasttext)``, ``image classification,
    digits (mlp)``."""
    task, model, schema = str(config.get("task", "image")), str(config.get("model", "")), _schema(config)
    objective = str(schema.get("objective", "classification"))
    if task == "image":
        data = f"{len(schema['classes'])} classes from image folders" if "classes" in schema else str(
            config.get("dataset", "digits"))
        what = f"image classification, {data}"
    elif task == "tabular" and "label" in schema:
        what = f"tabular {objective} of '{schema['label']}'"
    elif task == "text" and "label" in schema:
        what = f"text classification of '{schema['label']}' from '{schema.get('text', '?')}'"
    else:
        what = task
    return f"{what} ({model})" if model else what
