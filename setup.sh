#!/usr/bin/env bash
# Set up QuorumFL in ./.venv on Python >= 3.11.
#   ./setup.sh        the product (quorumfl command)
#   ./setup.sh --dev  plus the test and lint tools, and Flower's simulation engine (Ray) the tests use
#   ./setup.sh --simulation  plus Flower's simulation engine (Ray) for 'quorumfl simulate'
#   ./setup.sh [--dev] --city-data  plus the real city data of the tabular/text demos and benchmarks:
#                     Debian's r-cran-modeldata (Ames housing) and wordnet-base, unpacked into
#                     .venv/share/quorumfl/datasets (apt-get download + dpkg-deb -x: no R, no root), and PyPI rdata
# torch is installed first and only when missing, pinned to the 2.13 CPU wheel: an unpinned torch
# would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"

extras=""
city_data=0
for arg in "$@"; do
  case "$arg" in
    --dev) extras="[dev,simulation]" ;;
    --simulation) [ -n "$extras" ] || extras="[simulation]" ;;
    --city-data) city_data=1 ;;
    *) echo "setup.sh: unknown option '$arg' (use --dev, --simulation and/or --city-data)" >&2; exit 2 ;;
  esac
done

python=""
for candidate in "${PYTHON:-}" python3.11 python3.12 python3.13 python3; do
  [ -n "$candidate" ] || continue
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    python="$candidate"; break
  fi
done
[ -n "$python" ] || { echo "setup.sh: Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
  echo "setup.sh: installing torch 2.13.0 (CPU)"
  "${pip[@]}" torch==2.13.0
fi
echo "setup.sh: installing quorumfl${extras}"
# strict editable mode: a tree of links to the source files laid out as the quorumfl package (the
# folders map to quorumfl.* through package-dir), so tools that walk the package on disk
# (import-linter's lint-imports, mypy) see it; a new module needs this script run again.
"${pip[@]}" -e ".${extras}" --config-settings editable_mode=strict
# byte-compiled once here, as pip does for an installed wheel: every command then starts without
# compiling QuorumFL's modules (which it would redo each time where PYTHONDONTWRITEBYTECODE is set)
.venv/bin/python -m compileall -q "$(.venv/bin/python -c 'import quorumfl; print(next(iter(quorumfl.__path__)))')"
.venv/bin/quorumfl --help >/dev/null
if [ "$city_data" = 1 ]; then
  data="${QUORUMFL_DATASETS:-.venv/share/quorumfl/datasets}"
  mkdir -p "$data"
  if [ ! -f "$data/usr/share/wordnet/data.noun" ] || [ ! -f "$data/usr/lib/R/site-library/modeldata/data/Rdata.rdb" ]; then
    echo "setup.sh: fetching Debian's r-cran-modeldata and wordnet-base into $data"
    debs="$(mktemp -d)"
    (cd "$debs" && apt-get download r-cran-modeldata wordnet-base >/dev/null 2>&1) ||
      { echo "setup.sh: apt-get download r-cran-modeldata wordnet-base failed (is a Debian mirror reachable?)" >&2; exit 1; }
    for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$data"; done
    rm -rf "$debs"
  fi
  "${pip[@]}" "rdata>=1.1"  # the 'data' extra of pyproject.toml
  echo "setup.sh: city data ready in $data"
fi
echo "setup.sh: ready (.venv/bin/quorumfl)"
