#!/usr/bin/env bash
# Installs the CUDA compiler and runtime (headers + static cudart) inside a manylinux_2_28
# container for the CUDA major in $RAMSTREAM_CUDA_MAJOR (12 or 13). Used by cibuildwheel.
set -euo pipefail
major="${RAMSTREAM_CUDA_MAJOR:?set RAMSTREAM_CUDA_MAJOR to 12 or 13}"
case "$major" in
  12) ver=12-8 ;;
  13) ver=13-0 ;;
  *) echo "unsupported CUDA major: $major" >&2; exit 2 ;;
esac
dnf install -y dnf-plugins-core
dnf config-manager --add-repo https://developer.download.nvidia.com/compute/cuda/repos/rhel8/x86_64/cuda-rhel8.repo
dnf install -y "cuda-nvcc-${ver}" "cuda-cudart-devel-${ver}" "cuda-crt-${ver}" || \
  dnf install -y "cuda-nvcc-${ver}" "cuda-cudart-devel-${ver}"
ln -sfn "/usr/local/cuda-${ver/-/.}" /usr/local/cuda
/usr/local/cuda/bin/nvcc --version
