#!/usr/bin/env bash
# The GPU run, from the repository root: `python -m benchmarks.gpu` (the CUDA test
# cases and every GPU benchmark the docs name, one report; see its docstring), then
# `python -m benchmarks.launch` where that script exists.
#
#   bash benchmarks/gpu.sh [--install] [OUT_DIR] [extra options of benchmarks.gpu]
#
# Without --install nothing is installed and no virtualenv is made: the Python is
# $PYTHON (default python3) and must already import a CUDA torch and stiefel.
# With --install, on a machine whose nvidia-smi lists a GPU: when that Python's
# torch sees no CUDA device, a virtualenv .venv-gpu with the CUDA build of torch
# that pip serves; then the project, editable, from the wheels in .whl/ when that
# folder exists (a machine with no package registry: `pip download` them beside
# the checkout first), else with its test extra from the registry.
# On a machine with no CUDA device it says so and exits 1, before writing anything.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: bash benchmarks/gpu.sh [-h|--help] [--install] [OUT_DIR] [options of benchmarks.gpu]

Runs `python -m benchmarks.gpu --device cuda --out OUT_DIR` (the CUDA tests and the GPU
benchmarks, one report in OUT_DIR/report.md), then `python -m benchmarks.launch --device
cuda` where benchmarks/launch.py exists.

  OUT_DIR      the report's folder (default: $OUT, else gpu-report); it may not start
               with '-' (write ./-name for such a folder)
  --install    allowed to install: a virtualenv .venv-gpu with pip's CUDA torch when
               the Python's torch sees no GPU, and the project with its test extra
               (from .whl/ when that folder exists). Without it nothing is installed.
  -h, --help   this text

Environment: PYTHON (default python3), OUT.
Exit status: 1 on a machine without CUDA (or a Python without CUDA torch or stiefel
and no --install), 2 on a bad argument, else the run's.
EOF
}

install=0
while [ $# -gt 0 ]; do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --install)
            install=1
            shift
            ;;
        --)
            shift
            break
            ;;
        *) break ;;
    esac
done
out="${1:-${OUT:-gpu-report}}"
[ $# -gt 0 ] && shift
case "$out" in
    -*)
        echo "[gpu.sh] error: OUT_DIR '$out' starts with '-' (an option in the folder's" \
            "place?); give the folder first, or write ./$out" >&2
        usage >&2
        exit 2
        ;;
esac

cd "$(dirname "$0")/.." || exit 1
py="${PYTHON:-python3}"

torch_sees_cuda() {
    "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
}
gpu_listed() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

if ! torch_sees_cuda "$py"; then
    if ! gpu_listed; then
        echo "[gpu.sh] no CUDA device on this machine (nvidia-smi lists no GPU and $py's" \
            "torch sees none): this run is for a GPU machine; nothing done" >&2
        exit 1
    fi
    if [ "$install" -eq 0 ]; then
        echo "[gpu.sh] $py's torch sees no CUDA device though nvidia-smi lists one: set" \
            "PYTHON to a Python with CUDA torch, or pass --install to make .venv-gpu" >&2
        exit 1
    fi
    echo "[gpu.sh] $py has no CUDA torch: a new virtualenv .venv-gpu"
    python3 -m venv .venv-gpu && py=.venv-gpu/bin/python
    "$py" -m pip install -q torch || exit 1
    if ! torch_sees_cuda "$py"; then
        echo "[gpu.sh] the torch pip installed in .venv-gpu sees no CUDA device" >&2
        exit 1
    fi
fi

if [ "$install" -eq 1 ]; then
    if [ -d .whl ]; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-site \
            .whl/*.whl || exit 1
        export PYTHONPATH="/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
        # offline, an editable install needs setuptools in place; else the checkout on the path
        if ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
            mkdir -p /tmp/gpu-pkg && ln -sfn "$PWD" /tmp/gpu-pkg/stiefel
            export PYTHONPATH="/tmp/gpu-pkg:$PYTHONPATH"
        fi
    else
        "$py" -m pip install -q -e ".[test]" || exit 1
    fi
elif ! "$py" -c "import stiefel" 2>/dev/null; then
    echo "[gpu.sh] $py cannot import stiefel: install the project (pip install -e" \
        "\".[test]\") or pass --install" >&2
    exit 1
fi

mkdir -p -- "$out"
"$py" -c "import torch; print('[gpu.sh] torch', torch.__version__, torch.cuda.get_device_name())"
"$py" -m benchmarks.gpu --device cuda --out "$out" "$@"
rc=$?
if [ -f benchmarks/launch.py ]; then
    "$py" -m benchmarks.launch --device cuda 2>&1 | tee "$out/launch.log"
    launch_rc=$?
    [ "$rc" -eq 0 ] && rc=$launch_rc
    # one large point and one large batch: the eager and the captured step there
    "$py" -m benchmarks.launch --device cuda --sets st4096x64,batch4096 2>&1 |
        tee -a "$out/launch.log"
    launch_rc=$?
    [ "$rc" -eq 0 ] && rc=$launch_rc
fi
exit "$rc"
