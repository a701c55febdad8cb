"""Small department files for task tests: property sales (a table), citizen requests (text), scanned
forms (scikit-learn's digits written as image folders).

Generated with a seeded rule so every test knows what a model can learn from them; the files are
written as a department would export them (CSV with a header, JSONL).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

ZONES = ["residential", "commercial", "industrial", "mixed"]
TOPICS = {
    "roads": ["pothole", "asphalt", "street", "crossing", "traffic", "lane", "repair", "road"],
    "waste": ["bin", "garbage", "collection", "recycling", "litter", "container", "bulky", "trash"],
    "permits": ["permit", "building", "application", "extension", "licence", "approval", "plan", "fee"],
}
FILLER = ["please", "the", "on", "my", "near", "since", "week", "again", "thanks", "our", "is", "was"]


def property_rows(rows: int, *, seed: int, zone_bias: str | None = None) -> list[dict[str, object]]:
    """Sales: area (m²), year built, zone, sale price (a noisy linear rule) and a price band."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        zone = zone_bias if zone_bias is not None and rng.random() < 0.7 else ZONES[int(rng.integers(len(ZONES)))]
        area = float(rng.uniform(40, 400))
        year = int(rng.integers(1900, 2024))
        price = 1500 * area + 800 * (year - 1900) + {"residential": 0, "commercial": 60000, "industrial": -30000,
                                                      "mixed": 20000}[zone] + float(rng.normal(0, 15000))
        price = max(price, 1000.0)
        band = "high" if price > 400000 else "low"
        out.append({"parcel": f"P{int(rng.integers(1e6))}", "area": round(area, 1), "year_built": year, "zone": zone,
                    "sale_price": round(price, 2), "band": band})
    return out


def write_csv(path: Path, rows: list[dict[str, object]], *, columns: list[str] | None = None) -> Path:
    columns = columns or list(rows[0])
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def request_rows(rows: int, *, seed: int, topic_bias: str | None = None) -> list[dict[str, str]]:
    """Citizen requests: a few topic words among filler, labelled with the topic's office."""
    rng = np.random.default_rng(seed)
    names = list(TOPICS)
    out = []
    for _ in range(rows):
        topic = topic_bias if topic_bias is not None and rng.random() < 0.7 else names[int(rng.integers(len(names)))]
        words = list(rng.choice(TOPICS[topic], size=3)) + list(rng.choice(FILLER, size=5))
        rng.shuffle(words)
        out.append({"id": str(int(rng.integers(1e6))), "request": " ".join(words).capitalize() + ".", "office": topic})
    return out


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Rows as a Parquet file (pyarrow infers each column's type)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_digit_folder(root: Path, indices: range, *, fmt: str = "PNG") -> np.ndarray:
    """scikit-learn's digits as 8-bit greyscale images, one sub-folder per class; returns the pixels written."""
    digits = load_digits()
    pixels = np.round(digits.images[indices] / 16.0 * 255.0).astype(np.uint8)
    for n, (image, label) in enumerate(zip(pixels, digits.target[indices], strict=True)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L").save(folder / f"form-{n:04d}.{'png' if fmt == 'PNG' else 'jpg'}", format=fmt)
    return pixels


def write_sales_csv(path: Path, size: int, *, seed: int = 0) -> int:
    """About ``size`` bytes of property sales as CSV (parcel, area, year built, zone, district, sale
    price): a block of up to 400,000 distinct rows, repeated, so that gigabytes take seconds to write.
    The number of data rows."""
    rng = np.random.default_rng(seed)
    n = max(1000, min(400_000, size // 48))  # about 48 bytes a row
    area, year = rng.uniform(40, 400, n).round(1), rng.integers(1900, 2024, n)
    price = (1500 * area + 800 * (year - 1900) + rng.normal(0, 15000, n)).clip(1000).round(0)
    zone = np.array(ZONES)[rng.integers(0, len(ZONES), n)]
    district = np.array([f"district-{i:02d}" for i in range(40)])[rng.integers(0, 40, n)]
    block = "".join(f"P{i},{a},{y},{z},{d},{p:.0f}\n"
                    for i, (a, y, z, d, p) in enumerate(zip(area, year, zone, district, price, strict=True)))
    copies = max(1, size // len(block))
    with path.open("w") as f:
        f.write("parcel,area,year_built,zone,district,sale_price\n")
        for _ in range(copies):
            f.write(block)
    return copies * n
