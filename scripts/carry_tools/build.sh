#!/usr/bin/env bash
# Builds the carry bundles carry1..3 in $CARRY_DIR (default lab/tools, git-ignored) from PyPI
# (run on a machine with network; CPU only). docs/abstraction.md, "Carrying the tools".
# Wheels: the --no-deps closure of nvidia-cutlass-dsl[cu13]==4.8.1 and tilelang==0.1.15 minus
# what the device image already has (torch, numpy, cuda-bindings, protobuf, ml-dtypes, ...),
# and minus nvidia-cutlass-dsl-libs-cu12 (the cu13 flavor is the one CuTe DSL picks on the
# device's CUDA 13.0 driver; one flavor is enough).
# Each wheel is rewritten as an uncompressed (stored) zip with byte-identical members, then
# xz -9e'd: 99.5 MiB to carry instead of 170.8 MiB (3 device calls instead of 4).
# unpack.sh's MANIFEST holds these .xz files' sha256: a rebuild with another xz must update it.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p "${CARRY_DIR:=lab/tools}" && cd "$CARRY_DIR"
PY=${PY312:-/tmp/v312/bin/python}   # any Python with pip; only downloads and zips
export PIP_CONFIG_FILE=/dev/null
mkdir -p pypi stored
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 -d pypi \
  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-cu13==4.8.1 tilelang==0.1.15 apache-tvm-ffi==0.1.12 \
  torch_c_dlpack_ext==0.1.5 z3-solver==4.15.4.0
for w in pypi/*.whl; do
  b=$(basename "$w")
  [ -f "stored/$b.xz" ] && continue
  $PY - "$w" "stored/$b" <<'EOF'
import sys, zipfile
src, dst = sys.argv[1:3]
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zo:
    for info in zi.infolist():
        out = zipfile.ZipInfo(info.filename, info.date_time)
        out.external_attr, out.compress_type = info.external_attr, zipfile.ZIP_STORED
        zo.writestr(out, zi.read(info))
EOF
  xz -9e -T0 -f "stored/$b"   # stored/$b -> stored/$b.xz
done
rm -rf carry1 carry2 carry3 && mkdir carry1 carry2 carry3
# carry1: TileLang, complete (38.2 MiB); carry2 + carry3: CuTe DSL (the cu13 libs in two parts)
for p in tilelang- z3_solver- apache_tvm_ffi- torch_c_dlpack_ext-; do cp stored/$p*.xz carry1/; done
for p in nvidia_cutlass_dsl-4 nvidia_cutlass_dsl_libs_base- nvidia_cutlass_dsl_libs_core-; do cp stored/$p*.xz carry2/; done
cu13=$(ls stored/nvidia_cutlass_dsl_libs_cu13-*.xz)
split -n 2 "$cu13" "carry2/$(basename "$cu13").part-"
mv carry2/*.part-ab carry3/
du -sb carry1 carry2 carry3
