#!/usr/bin/env bash
# The GPU run on a bare GPU machine, from the repository root: install what is
# missing, then `python -m benchmarks.gpu` (the CUDA test cases and every GPU
# benchmark the docs name, one report; see its docstring).
#
#   bash benchmarks/gpu.sh [OUT_DIR] [extra options of benchmarks.gpu]
#
# Python: the first of $PYTHON, a python3 whose torch sees a GPU, or a new
# virtualenv .venv-gpu with the CUDA build of torch that pip serves.
# Packages: wheels in .whl/ when that folder exists (a machine with no package
# registry: `pip download` them beside the checkout first), else from the
# registry. The project is installed editable, without touching its deps.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-report}}"
shift || true
mkdir -p "$out"

py="${PYTHON:-python3}"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "[gpu.sh] $py has no CUDA torch: a new virtualenv .venv-gpu"
    python3 -m venv .venv-gpu && py=.venv-gpu/bin/python
    "$py" -m pip install -q torch || exit 1
fi

if [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
    # offline, an editable install needs setuptools in place; else the checkout on the path
    if ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
        mkdir -p /tmp/gpu-pkg && ln -sfn "$PWD" /tmp/gpu-pkg/stiefel
        export PYTHONPATH="/tmp/gpu-pkg:$PYTHONPATH"
    fi
else
    "$py" -m pip install -q -e ".[test]" || exit 1
fi

"$py" -c "import torch; print('[gpu.sh] torch', torch.__version__, torch.cuda.get_device_name())"
exec "$py" -m benchmarks.gpu --device cuda --out "$out" "$@"
