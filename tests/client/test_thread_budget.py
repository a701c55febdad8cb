"""A node's thread budget (``torch-threads``) caps torch's intra-op pool and numpy's BLAS pool alike.

Ten nodes often share one machine; numpy's OpenBLAS would otherwise keep a thread per core that spins
after each large ``np.dot`` (a secure payload's norm) and takes CPU from the other nodes' training.
Checked in a fresh interpreter, so the pools of the test process stay as they are."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quorumfl.client.steps import apply_thread_budget
from quorumfl.errors import ConfigError

_PROBE = """
import json, sys
import numpy, torch
from threadpoolctl import threadpool_info
from quorumfl.client.steps import apply_thread_budget
seen = []
for config in json.loads(sys.argv[1]):
    budget = apply_thread_budget(config)
    blas = sorted({pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"})
    seen.append({"budget": budget, "torch": torch.get_num_threads(), "blas": blas})
print(json.dumps(seen))
"""

# node config → the budget
CASES = [({}, 1), ({"torch-threads": 2}, 2), ({"torch-threads": 1}, 1)]


def test_the_budget_sets_torch_and_numpys_blas_pools() -> None:
    configs = [config for config, _ in CASES]
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(configs)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [{"budget": budget, "torch": budget, "blas": [budget]} for _, budget in CASES]


@pytest.mark.parametrize(("value", "says"), [(0, "torch-threads must be >= 1, got 0"),
                                             ("4", "node config 'torch-threads' must be int, got '4'"),
                                             (True, "node config 'torch-threads' must be int, got True")])
def test_a_bad_budget_is_refused_naming_the_key(value: object, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        apply_thread_budget({"torch-threads": value})
    assert says in str(err.value)
