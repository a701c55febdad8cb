"""The static checks of the README's test command, run before pytest: ruff, mypy strict, the layer
rule (import-linter's contracts in ``pyproject.toml``), the packaging build (``pip install .``
into a folder of its own: a real wheel, not the editable tree, imports, migrates a state DB and
names the CLI entry point) and the documentation site (``mkdocs build --strict``: every link between
pages and every anchor checked; the generated reference pages' freshness is a pytest test). ``python -m tests.static_checks`` prints one line per check and exits 1
when any fails, after printing what it found.

mypy and import-linter cannot follow setuptools' ``package-dir`` mapping (the folders install as
``quorumfl.*`` but there is no ``quorumfl/`` folder), so both run on a tree of symlinks laid out as
the installed package, built from that mapping in ``pyproject.toml``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def package_dirs() -> dict[str, str]:
    """The top-level ``quorumfl.*`` packages and their folders, as ``pyproject.toml`` maps them."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix("quorumfl."): folder for name, folder in mapping.items()}


def package_tree(base: Path) -> Path:
    """``base/quorumfl``: a regular package whose sub-packages are symlinks to the source folders."""
    tree = base / "quorumfl"
    tree.mkdir()
    (tree / "__init__.py").write_text("")
    for name, folder in package_dirs().items():
        (tree / name).symlink_to(ROOT / folder, target_is_directory=True)
    return base


def checks(tree: Path, cache: Path) -> list[tuple[str, list[str], dict[str, str], Path]]:
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(cache))}
    return [
        ("ruff", [str(BIN / "ruff"), "check", "--no-cache", "."], env, ROOT),
        ("mypy --strict", [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--no-incremental", "--cache-dir", str(cache / "mypy"), "-p", "quorumfl"],
         {**env, "MYPYPATH": str(tree)}, tree),
        ("import-linter (layers)", [str(BIN / "lint-imports"), "--no-cache", str(ROOT / "pyproject.toml")],
         {**env, "PYTHONPATH": str(tree)}, tree),
        ("docs: mkdocs build --strict", [str(BIN / "mkdocs"), "build", "--strict", "--quiet", "-d", str(cache / "site")],
         {**env, "NO_MKDOCS_2_WARNING": "1"}, ROOT),
    ]


PACKAGING_PROBE = (
    "import sys, quorumfl.server, quorumfl.client.app, quorumfl.cli.main, quorumfl.server.app;"
    "import quorumfl.aggregation.secagg, quorumfl.aggregation.ckks;"
    "from quorumfl.server.state.database import connect;"
    "connect('sqlite:///' + sys.argv[1], migrate=True);"
    "print(quorumfl.server.__file__)"
)


def packaging(base: Path) -> list[tuple[str, list[str], dict[str, str], Path]]:
    """``pip install .`` into ``base/site`` (no editable tree), then, with ``-S`` (no .pth files, so
    the editable install cannot fill in what the wheel lacks): import, migrate, and check the entry point."""
    site = base / "site"
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(base))}
    probe_env = {**env, "PYTHONPATH": f"{site}:{sysconfig.get_paths()['purelib']}"}
    check_entry = (f"import pathlib, sys; text = next(pathlib.Path({str(site)!r}).glob('quorumfl-*.dist-info'))"
                   ".joinpath('entry_points.txt').read_text(); "
                   "sys.exit(0 if 'quorumfl = quorumfl.cli.main:main' in text else 'entry point missing: ' + text)")
    return [
        ("packaging: pip install .", [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                                      "--no-build-isolation", "--target", str(site), str(ROOT)], env, base),
        ("packaging: the wheel imports and migrates", [sys.executable, "-S", "-c", PACKAGING_PROBE + "; "
                                                       f"assert quorumfl.server.__file__.startswith({str(site)!r})",
                                                       str(base / "w.db")], probe_env, base),
        ("packaging: entry point", [sys.executable, "-c", check_entry], env, base),
    ]


def main() -> int:
    failed = []
    with tempfile.TemporaryDirectory(prefix="quorumfl-static-") as tmp:
        tree = package_tree(Path(tmp))
        (Path(tmp) / "wheel").mkdir()
        for name, command, env, cwd in [*checks(tree, Path(tmp)), *packaging(Path(tmp) / "wheel")]:
            start = time.monotonic()
            result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
            seconds = time.monotonic() - start
            if result.returncode == 0:
                print(f"static checks: {name} passed ({seconds:.0f} s)", flush=True)
            else:
                failed.append(name)
                print(result.stdout + result.stderr, flush=True)
                print(f"static checks: {name} FAILED (exit {result.returncode}, {seconds:.0f} s)", flush=True)
    if failed:
        print(f"static checks: {len(failed)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
