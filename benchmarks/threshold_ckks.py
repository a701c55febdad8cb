"""What threshold CKKS costs: its cryptography per step, and per round against plaintext and single-key CKKS.

One invocation. First the steps in this process on one core, for a payload the size of the model
(``mlp-wide``, ~1.1M parameters, + 2) and N nodes with t = 0.6·N: the key ceremony (all N parties
in memory), one client's encryption (time and bytes on the wire), the server's homomorphic sum of N
encryptions, one partial decryption, and combining t partial decryptions (with decoding), plus the
largest error against numpy's sum. TenSEAL's own ``ckks_vector`` encryption of the same payload is
timed for comparison. Then one federation (SuperLink + N SuperNodes as processes on 127.0.0.1,
Flower's deployment engine, one local epoch per round) runs three runs one after the other:

1. QuorumFL, plaintext FedAvg;
2. QuorumFL, ``secure-aggregation = "ckks"`` (t = 0.6·N; the key ceremony happens in round 1);
3. single-key TenSEAL aggregation as NVIDIA FLARE does it (``single_key_ckks_app.py``): every client
   holds the secret key, the server adds ciphertexts and sends the encrypted sum back for the clients
   to decrypt next round (one round trip, no decryption round trip, no threshold).

Per-round wall time is the median over rounds (with ≥ 3 rounds, a round without the ceremony).

    python benchmarks/threshold_ckks.py             # 10 nodes, 5 rounds each, ~1.1M params
    python benchmarks/threshold_ckks.py --smoke     # 3 nodes, 1 round each, small MLP
    python benchmarks/threshold_ckks.py --json      # last line: one JSON object

Keys: plain_round_s, ckks_round_s, single_key_round_s, ckks_over_plain, ckks_over_single_key,
encrypt_s_per_client, bytes_per_client (the packed ciphertexts a train reply carries), bytes_over_float32
(bytes_per_client / the float32 update's bytes; the error bound is max_abs_error), sum_s (all N), partial_decrypt_s, combine_s, max_abs_error,
ceremony_s (in memory) and ckks_ceremony_round_s (deployed), single_key_encrypt_s, single_key_bytes,
server peak RSS per mode, per-round lists; what the signed contribution records add: tag_s_per_client
(hashing the c0 and signing), tag_bytes_per_client, tag_check_s (a decryptor's every refusal rule,
every contributor's signature included), decrypt_request_tag_bytes (per decryptor: a decryption
request carries no ciphertext, each decryptor derives the round's c1 itself).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import tenseal as ts
from cryptography.hazmat.primitives.asymmetric import ec

from _cli import parser as make_parser
from _cli import peak_rss_mb, report
from _common import (
    baseline_fab,
    baseline_rounds,
    bench_federation,
    quorumfl_rounds,
    round_seconds,
    sizes,
)
from quorumfl.aggregation.ckks import (
    CiphertextSum,
    CkksParams,
    ceremony_in_one_process,
    check_request,
    combine,
    contribute,
    encrypt_vector,
    pack_residues,
    partial_decrypt,
)
from quorumfl.aggregation.ckks.threshold import NONCE_BYTES
from quorumfl.aggregation.secagg import resolve_threshold
from quorumfl.aggregation.secagg.identity import sign
from quorumfl.server.state.repository import Repository


def _steps(length: int, nodes: int) -> dict[str, float]:
    """The cryptography of one round, step by step, in this process."""
    params = CkksParams()
    members = list(range(1, nodes + 1))
    t = resolve_threshold(0.6, nodes)
    start = time.perf_counter()
    coordinator, _, shares = ceremony_in_one_process(members, t, params)
    ceremony_s = time.perf_counter() - start
    assert coordinator.public_key is not None

    rng = np.random.default_rng(0)
    primes = params.send_primes(t, nodes, 8.0)
    values = [rng.normal(0.0, 0.01, length) for _ in members]
    nonce = os.urandom(NONCE_BYTES)
    encrypted, encrypt_s = [], []
    for m, v in zip(members, values, strict=True):
        start = time.perf_counter()
        encrypted.append(encrypt_vector(shares[m], v, primes=primes, round_number=1, group=0, nonce=nonce,
                                        wire=True))
        encrypt_s.append(time.perf_counter() - start)
    total = CiphertextSum(params, length=length, primes=primes)
    start = time.perf_counter()
    for m, polys in zip(members, encrypted, strict=True):
        total.add(m, polys)
    sum_s = time.perf_counter() - start
    node_key = ec.generate_private_key(ec.SECP384R1())  # the size and cost of a department's signature
    tags, tag_s = [], []
    for m, polys in zip(members, encrypted, strict=True):
        start = time.perf_counter()
        tags.append(contribute(shares[m], polys, round_number=1, group=0, nonce=nonce, length=total.length,
                               primes=total.level, department=f"department-{m}",
                               signer=lambda message: sign(node_key, message)))
        tag_s.append(time.perf_counter() - start)
    tag_bytes = [len(tag.department) + len(tag.digest) + len(tag.signature) + 8 for tag in tags]
    manifest = total.manifest(key_id=coordinator.key_id, round=1, group=0, nonce=nonce, subset=members[:t])
    start = time.perf_counter()
    check_request(shares[members[0]], manifest, set(), tags)  # unsigned here: signatures cost ~1 ms each
    tag_check_s = time.perf_counter() - start
    partials, partial_s = {}, []
    for m in manifest.subset:
        start = time.perf_counter()
        partials[m] = partial_decrypt(shares[m], manifest, set(), tags)
        partial_s.append(time.perf_counter() - start)
    start = time.perf_counter()
    result = combine(params, total.c0, partials, manifest)
    combine_s = time.perf_counter() - start
    error = float(np.max(np.abs(result - np.sum(np.stack(values), axis=0))))

    context = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 40])
    context.global_scale = 2.0**40
    start = time.perf_counter()
    single = ts.ckks_vector(context, values[0].tolist()).serialize()
    single_s = time.perf_counter() - start
    return {
        "ceremony_s": ceremony_s,
        "encrypt_s_per_client": statistics.median(encrypt_s),
        "bytes_per_client": float(pack_residues(encrypted[0]).nbytes),  # as the train reply carries it
        "bytes_over_float32": pack_residues(encrypted[0]).nbytes / (4.0 * length),
        "sum_s": sum_s,
        "partial_decrypt_s": statistics.median(partial_s),
        "combine_s": combine_s,
        "max_abs_error": error,
        "predicted_error_std": params.error_std(t, nodes),
        "partial_bytes": float(pack_residues(partials[manifest.subset[0]]).nbytes),
        "tag_s_per_client": statistics.median(tag_s),
        "tag_bytes_per_client": float(statistics.median(tag_bytes)),
        "tag_check_s": tag_check_s,
        "decrypt_request_tag_bytes": float(sum(tag_bytes)),
        "single_key_encrypt_s": single_s,
        "single_key_bytes": float(len(single)),
    }


def _write_contexts(home: Path) -> tuple[Path, Path]:
    context = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 40])
    context.global_scale = 2.0**40
    secret, public = home / "single-key-secret.ctx", home / "single-key-public.ctx"
    secret.write_bytes(context.serialize(save_secret_key=True))
    context.make_context_public()
    public.write_bytes(context.serialize())
    return secret, public


def _server_rss(repo: Repository) -> float:
    run = repo.list_runs()[-1]
    return max((m.value for m in repo.metrics(run.id, name="server-peak-rss-mb")), default=float("nan"))


def main() -> None:
    size = sizes(make_parser(__doc__ or ""))
    figures: dict[str, Any] = {"nodes": size.nodes, "rounds": size.rounds, "model": size.model, "params": size.params}
    figures.update(_steps(size.params + 2, size.nodes))
    with bench_federation(size) as bench:
        plain = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "none"})
        plain_rss = _server_rss(bench.repo)
        ckks = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "ckks",
                                                              "secagg-threshold": 0.6, "secagg-stage-timeout": 900.0})
        ckks_rss = _server_rss(bench.repo)
        secret, public = _write_contexts(bench.home)
        timings = bench.home / "single-key.jsonl"
        fab = baseline_fab("single-key-ckks-baseline", "single_key_ckks_app", ["single_key_ckks_app.py"],
                           {**size.common, "num-nodes": size.nodes, "round-timeout": 900.0, "context-file": str(secret),
                            "public-context-file": str(public), "timings-file": str(timings)})
        single = baseline_rounds(bench.federation, fab, timings, size.rounds)

    plain_s = statistics.median(round_seconds(t) for t in plain)
    ckks_s = statistics.median(round_seconds(t) for t in ckks)
    single_s = statistics.median(single)
    figures.update({
        "plain_round_s": plain_s,
        "ckks_round_s": ckks_s,
        "single_key_round_s": single_s,
        "ckks_over_plain": ckks_s / plain_s,
        "ckks_over_single_key": ckks_s / single_s,
        "ckks_ceremony_round_s": ckks[0].get("ckks-ceremony", 0.0),
        "ckks_decrypt_trip_s": statistics.median(t.get("ckks-decrypt", 0.0) for t in ckks),
        "plain_rounds_s": [round(round_seconds(t), 2) for t in plain],
        "ckks_rounds_s": [round(round_seconds(t), 2) for t in ckks],
        "single_key_rounds_s": [round(s, 2) for s in single],
        "plain_server_peak_rss_mb": plain_rss,
        "ckks_server_peak_rss_mb": ckks_rss,
        "bench_peak_rss_mb": peak_rss_mb(),
    })
    report(figures, as_json=size.as_json)


if __name__ == "__main__":
    main()
