"""``quorumfl data``: split a built-in dataset, propose a schema, import and check a department's data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from quorumfl.cli.output import Format, console, file_progress, print_json
from quorumfl.core.data import check_data, import_partition, prepare_partitions, propose_schema
from quorumfl.core.data.datasets import FASHION_MNIST_DIR
from quorumfl.core.data.departments import split_packaged
from quorumfl.core.data.packaged import PACKAGED
from quorumfl.core.data.planted import plant_partitions
from quorumfl.core.files import atomic_write
from quorumfl.core.tasks import read_schema, schema_digest
from quorumfl.errors import ConfigError

data_app = typer.Typer(help="Department data: import a department's file, propose and check schemas, split "
                            "built-in datasets.", no_args_is_help=True)

FormatOpt = Annotated[Format, typer.Option("--format", help="Output format.")]
SchemaOpt = Annotated[Path, typer.Option(help="The shared schema file (JSON, from 'quorumfl data schema').")]


def _read_schema(path: Path) -> dict[str, object]:
    return read_schema(str(path), key="--schema")


@data_app.command("schema")
def schema(
    source: Annotated[Path, typer.Argument(help="A sample CSV, JSONL or Parquet file with the departments' columns (image task: a folder of class sub-folders).")],
    task: Annotated[str, typer.Option(help="tabular, text, or your own task (module:attribute).")] = "tabular",
    label: Annotated[str, typer.Option(help="The label (target) column.")] = "",
    text: Annotated[str, typer.Option(help="text task: the column holding the text.")] = "",
    objective: Annotated[str, typer.Option(help="tabular: auto, classification or regression.")] = "auto",
    categorical: Annotated[str, typer.Option(help="tabular: columns to treat as categories although numeric "
                                                  "(comma-separated).")] = "",
    ignore: Annotated[str, typer.Option(help="Columns to leave out, such as record ids (comma-separated).")] = "",
    buckets: Annotated[int, typer.Option(help="Hash buckets per categorical column (tabular) or for n-grams (text; "
                                              "0 = the task's default).")] = 0,
    min_share: Annotated[float | None, typer.Option(help="tabular: the share of the federation's records a "
                                                         "category needs for a model input of its own (rarer ones "
                                                         "are pooled; counted under the run's secure aggregation; "
                                                         "default 0.01, 0 keeps all).")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the schema here (default: print it).")] = None,
) -> None:
    """Propose the schema every department's data must fit, from a sample file; review it and share it."""
    options = {"label": label, "text": text, "objective": objective, "categorical": categorical, "ignore": ignore}
    if buckets:
        options["buckets"] = str(buckets)
    if min_share is not None:
        options["min_share"] = str(min_share)
    proposed = propose_schema(source, task, {k: v for k, v in options.items() if v})
    body = json.dumps(proposed, indent=2) + "\n"
    if out is None:
        console.print(body, end="", highlight=False, soft_wrap=True)
        return
    atomic_write(out, body.encode())
    console.print(f"schema for task '{proposed['task']}' written to {out} (digest {schema_digest(proposed)[:12]}); "
                  "review it, then give it to every department", highlight=False, soft_wrap=True)


@data_app.command("import")
def import_data(
    source: Annotated[Path, typer.Argument(help="This department's CSV, JSONL or Parquet file, or (image task) its folder of class sub-folders.")],
    schema: SchemaOpt,
    department: Annotated[str, typer.Option(help="This department's name.")],
    out: Annotated[Path, typer.Option(help="The partition directory to write (the node's --data).")],
    test_fraction: Annotated[float, typer.Option(help="Share of rows kept for the department's own test split.")] = 0.2,
    seed: Annotated[int, typer.Option(help="Seed of the train/test split.")] = 0,
) -> None:
    """Check a department's file against the shared schema and write its partition directory."""
    with file_progress() as hear:
        part = import_partition(source, out, department=department, schema=_read_schema(schema),
                                test_fraction=test_fraction, seed=seed, on_progress=hear)
    console.print(f"{part.department}: {part.train_examples} training and {part.test_examples} test examples in {out}",
                  highlight=False, soft_wrap=True)


@data_app.command("check")
def check(
    path: Annotated[Path, typer.Argument(help="A partition directory, or a CSV/JSONL file (with --schema).")],
    schema: Annotated[Path | None, typer.Option(help="The shared schema the data must fit.")] = None,
    fmt: FormatOpt = Format.TABLE,
) -> None:
    """Say whether a department's data fits the schema (exit 4 naming the row, column or class if not); writes nothing."""
    with file_progress() as hear:
        view = check_data(path, _read_schema(schema) if schema is not None else None, on_progress=hear)
    if fmt is Format.JSON:
        print_json(view)
        return
    what = (f"{view['department']}: {view['train_examples']} training and {view['test_examples']} test examples"
            if "department" in view else f"{view['rows']} rows")
    verdict = "fits the schema" if view["fits"] else "is a valid partition"
    console.print(f"{path} ({view['task']}, schema {view['schema_digest'][:12]}): {what}; {verdict}",
                  highlight=False, soft_wrap=True)


@data_app.command("split")
def data_split(
    out: Annotated[Path, typer.Option(help="Folder to create one partition directory per department in.")],
    departments: Annotated[str, typer.Option(help="Comma-separated department names.")],
    dataset: Annotated[str, typer.Option(help="digits or fashion-mnist (image); ames (tabular: property sales) or "
                                              "wordnet (text: noun glosses), from ./setup.sh --city-data.")] = "digits",
    method: Annotated[str, typer.Option(help="iid, dirichlet or shards; natural for ames (whole neighbourhoods "
                                             "per department).")] = "dirichlet",
    alpha: Annotated[float, typer.Option(help="Dirichlet α.")] = 0.5,
    labels_per_node: Annotated[int, typer.Option(help="Classes per node for 'shards'.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the split.")] = 0,
    data_dir: Annotated[Path | None, typer.Option(help=f"Fashion-MNIST IDX folder (default {FASHION_MNIST_DIR}).")] = None,
    planted_groups: Annotated[int, typer.Option(help="Plant this many groups of departments, each with its own "
                                                     "label permutation, to measure cluster recovery (0: none).")] = 0,
) -> None:
    """Split a built-in dataset into department partition directories (each node gets only its own);
    ames and wordnet also write each department's own file and the schema (OUT/schema.json) to give
    'runs start --schema'."""
    names = [d.strip() for d in departments.split(",") if d.strip()]
    if dataset in PACKAGED:
        if planted_groups:
            raise ConfigError("--planted-groups permutes image labels; it does not apply to ames or wordnet")
        parts, _ = split_packaged(dataset, out, names, split=method, seed=seed, alpha=alpha)
        for name, path in parts.items():
            console.print(f"{name}: {path}", soft_wrap=True)
        console.print(f"schema: {out / 'schema.json'} (task {PACKAGED[dataset]})", soft_wrap=True)
        return
    paths = prepare_partitions(out, names, dataset=dataset, method=method, alpha=alpha,
                               labels_per_node=labels_per_node, seed=seed, data_dir=data_dir)
    groups = plant_partitions(paths, planted_groups, seed=seed) if planted_groups else {}
    for name, path in paths.items():
        # soft_wrap: one line per department, so paths stay whole for copying and for scripts
        console.print(f"{name}: {path}" + (f" (planted group {groups[name]})" if groups else ""), soft_wrap=True)
