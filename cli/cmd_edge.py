"""``quorumfl models promote``, and ``quorumfl edge …``: signing keys, the artifact registry, the
sync server, and the device side (sync, predict, rollback)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from quorumfl.cli.context import settings
from quorumfl.cli.output import Format, console, err_console, print_json, table
from quorumfl.errors import ArtifactError, ConfigError, DataError

edge_app = typer.Typer(help="Edge devices: signed INT8 artifacts and model sync.", no_args_is_help=True)
artifacts_app = typer.Typer(help="Signed INT8 artifacts published for edge devices.", no_args_is_help=True)
edge_keys_app = typer.Typer(help="The Ed25519 key that signs edge artifacts.", no_args_is_help=True)
edge_app.add_typer(artifacts_app, name="artifacts")
edge_app.add_typer(edge_keys_app, name="keys")

FormatOpt = Annotated[Format, typer.Option("--format", help="Output format.")]
ChannelOpt = Annotated[str, typer.Option(help="Release channel: stable or canary.")]
ArtifactFormatOpt = Annotated[str, typer.Option("--artifact-format", help="Artifact format: onnx or pte.")]


def promote(
    ctx: typer.Context,
    version: Annotated[int, typer.Argument(help="Model version id.")],
    edge: Annotated[bool, typer.Option(help="Also export the model for edge devices (QAT and INT8 by default), "
                                             "as ONNX and ExecuTorch, sign and publish the artifacts.")] = False,
    precision: Annotated[str, typer.Option(help="int8 (QAT, INT8 weights and activations), dynamic (INT8 weights, "
                                                "ONNX only: for models with an embedding table) or fp32.")] = "int8",
    channel: ChannelOpt = "stable",
    partition: Annotated[Path | None, typer.Option(help="QAT and measurement on this department partition folder "
                                                         "(a node's data) instead of the server's held-out set; "
                                                         "needed for models of departments' own data.")] = None,
    qat_epochs: Annotated[int, typer.Option(help="QAT fine-tuning epochs.")] = 2,
    qat_lr: Annotated[float, typer.Option(help="QAT learning rate.")] = 0.005,
    sparsity: Annotated[float, typer.Option(help="int8 only: zero this fraction of each layer's smallest weights "
                                                  "before QAT and keep them zero (0 to 0.95); the download, a zlib "
                                                  "stream, shrinks with them.")] = 0.0,
    key: Annotated[Path | None, typer.Option(help="Ed25519 signing key (default HOME/edge/signing-key.pem, "
                                                   "created on first use).")] = None,
) -> None:
    """Mark a model version as promoted; with --edge, publish it as signed edge artifacts."""
    from quorumfl.edge.export import parse_precision
    from quorumfl.edge.manifest import parse_channel
    from quorumfl.edge.promotion import promote_to_edge
    from quorumfl.edge.qat import QatSettings

    opts = settings(ctx)
    repo = opts.repository()
    if not edge:
        repo.get_model_version(version)
        repo.add_tag(version, "promoted")
        console.print(f"model version {version} promoted (add --edge to publish it to edge devices)")
        return
    chosen = parse_channel(channel)
    level = parse_precision(precision)
    qat = QatSettings(epochs=qat_epochs, learning_rate=qat_lr, sparsity=sparsity)
    with console.status(f"{level.value} export of model version {version}…"):
        rows, calibration, created = promote_to_edge(repo, version, home=opts.home, channel=chosen,
                                                     partition=partition, key_path=key, settings=qat, precision=level)
    if created:
        console.print(f"created the edge signing key {opts.home / 'edge' / 'signing-key.pem'}; give edge devices "
                      f"its public key {opts.home / 'edge' / 'signing-key.pub.pem'}")
    manifest = json.loads(rows[0].manifest)
    console.print(f"{'QAT' if level.value == 'int8' else 'measured on'} data: {calibration.source}")
    pruned = f", {manifest['sparsity']:.0%} of weights pruned" if manifest.get("sparsity") else ""
    console.print(f"{manifest['metric']}: fp32 model {manifest['fp32_metric']}, {manifest['precision']} artifact "
                  f"(onnxruntime) {manifest['edge_metric']}{pruned}")
    for row in rows:
        console.print(f"artifact v{row.version} {row.format} ({row.channel}): {row.size_bytes} bytes, "
                      f"sha256 {row.sha256[:12]}…")


@edge_keys_app.command("init")
def keys_init(
    ctx: typer.Context,
    key: Annotated[Path | None, typer.Option(help="Where to create the key (default HOME/edge/signing-key.pem).")] = None,
) -> None:
    """Create the Ed25519 signing key (refuses to overwrite one)."""
    from quorumfl.edge.promotion import default_key_path
    from quorumfl.edge.signing import create_signing_key, public_key_path

    path = key or default_key_path(settings(ctx).home)
    create_signing_key(path)
    console.print(f"signing key {path} (0600); public key for edge devices: {public_key_path(path)}")


@edge_keys_app.command("show")
def keys_show(
    ctx: typer.Context,
    key: Annotated[Path | None, typer.Option(help="The signing key (default HOME/edge/signing-key.pem).")] = None,
) -> None:
    """Print the public key that edge devices verify artifacts with."""
    from quorumfl.edge.promotion import default_key_path
    from quorumfl.edge.signing import load_private_key, public_key_path

    path = key or default_key_path(settings(ctx).home)
    load_private_key(path)
    print(public_key_path(path).read_text(), end="")


@edge_keys_app.command("rotate")
def keys_rotate(
    ctx: typer.Context,
    key: Annotated[Path | None, typer.Option(help="The signing key (default HOME/edge/signing-key.pem).")] = None,
) -> None:
    """Replace the signing key with a new one that the old key endorses; devices follow on their next
    sync. (A stolen key is not revoked this way: docs/how-to/edge-devices.md.)"""
    from datetime import UTC, datetime

    from quorumfl.edge.promotion import default_key_path
    from quorumfl.edge.rotation import chain_path, rotate_signing_key
    from quorumfl.edge.signing import public_key_path
    from quorumfl.server.state.artifacts import ArtifactRecords

    path = key or default_key_path(settings(ctx).home)
    records = ArtifactRecords(settings(ctx).repository().sessions)
    done = rotate_signing_key(path, records, created_at=datetime.now(UTC).isoformat(timespec="seconds"))
    if done.finished_interrupted:
        console.print(f"finished an interrupted rotation: key {done.sequence} ({done.fingerprint[:16]}…) is in place, "
                      f"{done.resigned} manifest(s) signed again; run the command again to rotate")
        return
    console.print(f"signing key {done.sequence} ({done.fingerprint[:16]}…) endorsed by key {done.sequence - 1} in "
                  f"{chain_path(path)}; {done.resigned} manifest(s) signed again. Devices move to it on their next "
                  f"sync; new devices get {public_key_path(path)}")


@artifacts_app.command("list")
def artifacts_list(
    ctx: typer.Context,
    channel: Annotated[str | None, typer.Option(help="Only this channel.")] = None,
    fmt: FormatOpt = Format.TABLE,
) -> None:
    """Published artifacts: version, channel, format, precision, sparsity, size, SHA-256, parent model version,
    metric."""
    from quorumfl.server.state.artifacts import ArtifactRecords

    rows: list[dict[str, Any]] = []
    for row in ArtifactRecords(settings(ctx).repository().sessions).list(channel=channel):
        manifest = json.loads(row.manifest)
        rows.append({"version": row.version, "channel": row.channel, "format": row.format, "size": row.size_bytes,
                     "sha256": row.sha256, "parent_model_version": row.model_version_id,
                     "architecture": manifest["architecture"], "precision": manifest.get("precision", "int8"),
                     "metric": manifest.get("metric", "accuracy"),  # schema 1 (before tasks): INT8 accuracy
                     "edge_metric": manifest.get("edge_metric", manifest.get("int8_accuracy")),
                     "fp32_metric": manifest.get("fp32_metric", manifest.get("fp32_accuracy")),
                     "sparsity": manifest.get("sparsity", 0.0),
                     "created_at": manifest["created_at"]})
    if fmt is Format.JSON:
        print_json(rows)
        return
    for view in rows:
        view["sha"] = view["sha256"][:12]
    console.print(table("Edge artifacts", rows, ["version", "channel", "format", "precision", "sparsity", "size",
                                                 "parent_model_version", "metric", "edge_metric", "fp32_metric", "sha"]))


@edge_app.command("serve")
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 9095,
    tls_cert: Annotated[Path | None, typer.Option(help="TLS certificate (PEM); with --tls-key.")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="TLS private key (PEM).")] = None,
    key: Annotated[Path | None, typer.Option(help="The signing key whose endorsement chain devices get "
                                                   "(default HOME/edge/signing-key.pem; only its public chain "
                                                   "file is read).")] = None,
) -> None:
    """Serve the artifact registry to edge devices until interrupted."""
    from quorumfl.edge.promotion import default_key_path
    from quorumfl.edge.rotation import load_chain
    from quorumfl.edge.service import start_server
    from quorumfl.server.state.artifacts import ArtifactRecords

    records = ArtifactRecords(settings(ctx).repository().sessions)
    path = key or default_key_path(settings(ctx).home)
    load_chain(path)  # a damaged chain file: refuse to start, naming it
    server = start_server(records, host=host, port=port, tls_cert=tls_cert, tls_key=tls_key,
                          key_chain=lambda: load_chain(path))
    console.print(f"edge sync serving on {host}:{server.port} ({'TLS' if tls_cert else 'no TLS'})")
    try:
        server.server.wait_for_termination()
    finally:
        server.stop()


def _device_opts(channel: str, artifact_format: str) -> tuple[Any, Any]:
    from quorumfl.edge.export import ArtifactFormat
    from quorumfl.edge.manifest import parse_channel

    try:
        fmt = ArtifactFormat(artifact_format)
    except ValueError:
        raise ConfigError(f"--artifact-format must be onnx or pte, got {artifact_format!r}") from None
    return parse_channel(channel), fmt


@edge_app.command("sync")
def sync(
    server: Annotated[str, typer.Option(help="Sync server HOST:PORT.")],
    directory: Annotated[Path, typer.Option("--dir", help="The device's model folder.")],
    public_key: Annotated[Path, typer.Option(help="The server's edge public key (PEM).")],
    channel: ChannelOpt = "stable",
    artifact_format: ArtifactFormatOpt = "onnx",
    ca_cert: Annotated[Path | None, typer.Option(help="CA certificate for TLS (default: no TLS).")] = None,
    every: Annotated[float, typer.Option(help="Keep syncing every SECONDS (0 = once).")] = 0.0,
    timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 60.0,
    fmt: FormatOpt = Format.TABLE,
) -> None:
    """Download the channel's newest artifact when newer, verify it, swap it in (previous kept)."""
    from quorumfl.edge.sync import sync as run_sync

    chosen, artifact = _device_opts(channel, artifact_format)
    while True:
        try:
            result = run_sync(server, directory, channel=chosen, fmt=artifact, public_key=public_key,
                              ca_cert=ca_cert, timeout=timeout)
        except ArtifactError as exc:
            if every <= 0:
                raise
            # keep watching: the installed model is unchanged, and a broken download resumes next time
            err_console.print(f"[red]sync failed: {exc}[/red]", highlight=False, soft_wrap=True)
            time.sleep(every)
            continue
        if fmt is Format.JSON:
            print_json(result.__dict__)
        elif result.status == "updated":
            resumed = f", resumed at byte {result.resumed_from}" if result.resumed_from else ""
            as_delta = f" as a delta against v{result.delta_from}" if result.delta_from else ""
            console.print(f"installed v{result.version} (previous v{result.previous or '-'}; "
                          f"{result.downloaded_bytes} bytes downloaded{as_delta}{resumed})")
        elif result.status == "up-to-date":
            console.print(f"up to date at v{result.version}")
        else:
            console.print(f"the {channel} channel has no {artifact_format} artifact yet")
        if every <= 0:
            return
        time.sleep(every)


@edge_app.command("predict")
def predict(
    directory: Annotated[Path, typer.Option("--dir", help="The device's model folder.")],
    input_file: Annotated[Path | None, typer.Option("--input", help=".npy of encoded examples (the artifact's input "
                                                                     "shape and dtype), or a department partition "
                                                                     "folder (its test split, with labels); default: "
                                                                     "samples of a built-in image dataset.")] = None,
    samples: Annotated[int, typer.Option(help="How many examples of a dataset or partition.")] = 8,
    public_key: Annotated[Path | None, typer.Option(help="Also check the installed manifest's signature.")] = None,
    fmt: FormatOpt = Format.TABLE,
) -> None:
    """Run the installed model on examples and print its predictions (and the task's metric when
    the examples have labels)."""
    from quorumfl.core.data.datasets import DATASETS, holdout_split
    from quorumfl.core.data.store import read_partition
    from quorumfl.core.tasks import CLASSIFICATION, Objective
    from quorumfl.edge.sync import load_current

    if samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    manifest, model = load_current(directory, public_key=public_key)
    labels, objective = None, None
    if input_file is not None and input_file.is_dir():
        test = read_partition(input_file).test
        x, labels, objective = test.x[:samples], test.y[:samples], test.objective
    elif input_file is not None:
        try:
            x = np.load(input_file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"--input {input_file} is not a readable .npy array ({exc})") from exc
    elif manifest.dataset in DATASETS:
        _, held_out = holdout_split(manifest.dataset, seed=0)
        x, labels, objective = held_out.x[:samples], held_out.y[:samples], held_out.objective
    else:
        raise ConfigError(f"--input: the model was trained on departments' own data ({manifest.dataset}); pass a "
                          "department's partition folder or an .npy of examples encoded by the task")
    start = time.perf_counter()
    outputs = model(x)
    elapsed = time.perf_counter() - start
    regression = manifest.metric != "accuracy"
    view: dict[str, Any] = {"version": manifest.version, "format": manifest.format.value,
                            "precision": manifest.precision, "samples": len(outputs), "seconds": round(elapsed, 6)}
    if regression:  # the model predicts the target scaled to [0, 1] of the schema's range
        unit = objective.unit if objective is not None else 1.0
        view["predicted" if objective is not None else "predicted_scaled"] = [round(float(v) * unit, 6) for v in outputs[:, 0]]
    else:
        view["predicted"] = outputs.argmax(1).tolist()
    if labels is not None and objective is not None:
        import torch

        chosen: Objective = objective if regression else CLASSIFICATION
        view["labels"] = (labels * chosen.unit).tolist() if regression else labels.tolist()
        view[manifest.metric] = chosen.finish(chosen.sums(torch.from_numpy(outputs), torch.from_numpy(labels)),
                                              len(labels))[manifest.metric]
    if fmt is Format.JSON:
        print_json(view)
        return
    for key, value in view.items():
        console.print(f"[bold]{key}[/bold]: {value}")


@edge_app.command("rollback")
def rollback(directory: Annotated[Path, typer.Option("--dir", help="The device's model folder.")]) -> None:
    """Swap back to the previously installed artifact."""
    from quorumfl.edge.sync import rollback as run_rollback

    state = run_rollback(directory)
    assert state.current is not None and state.previous is not None
    err_console.print(f"now at v{state.current.manifest.version} (v{state.previous.manifest.version} kept as previous)")
