#!/usr/bin/env bash
# Installs CuTe DSL (nvidia-cutlass-dsl 4.8.1, cu13 flavor) and TileLang 0.1.15 on the device
# machine from the carried bundles, with no network.
#
#   bash scripts/carry_tools/unpack.sh [CARRIED=/tmp/carried] [TARGET=/tmp/tools]
#
# Before it: each device call carries one bundle (lab/tools/carry1, carry2, carry3: build.sh) and copies
# it with   mkdir -p /tmp/carried && cp lab/tools/carryN/* /tmp/carried/
# (the machine keeps /tmp only while it stays warm: chain the calls). carry1 alone is TileLang
# complete; carry2 + carry3 are CuTe DSL. What is complete is installed, what is not is named.
#
# Each wheel travels as <wheel>.xz (or <wheel>.xz.part-aa, -ab, ...): the PyPI wheel rewritten
# as an uncompressed zip with byte-identical members, then xz'd. This script: cats the parts in
# order, checks the sha256 of the .xz, decompresses, checks the sha256 of the wheel, checks every
# member against the wheel's own RECORD (the same hashes as PyPI's wheel), then
# pip install --no-deps --no-index --target TARGET, and tries the imports.
#
# Afterwards, in the same call or a later one while the machine is warm:
#   . /tmp/tools/env.sh    # PYTHONPATH=/tmp/tools:/tmp/tools/nvidia_cutlass_dsl/dsl_packages
# (the second entry stands in for nvidia_cutlass_dsl_packages.pth, which a --target install
# on PYTHONPATH does not process: without it `import cutlass` fails).
set -uo pipefail
CARRIED=${1:-/tmp/carried}
TARGET=${2:-/tmp/tools}
PY=${PYTHON:-python3}
WORK=$CARRIED/.reassembled
mkdir -p "$WORK"

# group wheel sha256(.xz) sha256(stored .whl) sha256(PyPI's .whl, for the record)
MANIFEST='
tilelang tilelang-0.1.15-cp39-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl cde99c872bbbc327dbe375a58ccdf1596ddb22ddb1407741cc1f11037a1248d0 093d57e889f14d9c5e21a9460de2a1925e15e1ae1a12e72ba3c9c590297e504f ca021a3450ad84b8fe7deb1b659c8d3d2e4b0855fdb59e2992a5349acf019881
tilelang z3_solver-4.15.4.0-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl c7c37ad7b9f159f4b63deacdf0d368786f5d9b8f602833d62448545d16107a94 1996347319a5d2eab195941e31b697de4850a2c9bf4951c55af829871a9c8139 7e103a6f203f505b8b8b8e5c931cc407c95b61556512d4921c1ddc0b3f41b08e
tilelang apache_tvm_ffi-0.1.12-cp312-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl a00a7e8f6bb1a23044df6a7cf8923b295b2054c44aff39a5d25e6b14b2345b4b dd2e319b22958430c8199b9703060240327126223e223e85542a131621a4f17d dc0acd7eeb0e451d5e3f686af3ba0b495fdbf97b5b54cf9a0f770cdafe0e691a
tilelang torch_c_dlpack_ext-0.1.5-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl 238756cca97d7e93dab294c0be7b325f1407529bd19254fc539066a98bd76e49 022584ce7c55bfbe70f50f9dbfd0e704214320646679c1a3633014388d7aae74 e6f9da4bb9af70e27facc777458be62e10dbbbddda7672d16138db0553c5a524
cute nvidia_cutlass_dsl-4.8.1-py3-none-any.whl 3a1691ae6f8276c117fc77acc667e83e1c072ec005c4bb7f678c5ebaf29b3708 aa8c547b844f41ef6d6970f4edbea0e50b691dd46a8cad2c45c625dfd4ba8ebc 43ed46b21d151aa643c6765457c7310827b938c1cf45d5109a0152de4ef06227
cute nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl cc424bbe3509b7afd262f5053061af2c45cad982c334012e7b7a77f6e272b832 6b17ca458294f543f06c97623ce21b37d8de88e517bdaba710c1394852c1c02c ac2fd8c7fa3d6ded00917fa7cba8686061005da8c4703c6a29e03c1504543909
cute nvidia_cutlass_dsl_libs_core-4.8.1-py3-none-any.whl e4312cf9851ce9007ff01f288f6f393031550d43f5538a0221be065024135d80 dfea8fb15273063ced6baf00d2f5ca7326de35a3081424e6489aaf1863a28b5f bacc6760e3286db447d45720d32ae58ac2e6cecade1152345ef784b2d5e44431
cute nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl d58f29e832119e13deb35bff94847fdb5847e6678af3bb921e522148ae682631 20ead9f32044f83ee59a8c57085aa5024fd9f620adb6aff894678d8df40546bf 50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90
'

sha() { sha256sum "$1" | cut -c1-64; }
unxz_to() {  # $1 .xz -> $2; xz if there, else Python's lzma
  if command -v xz >/dev/null 2>&1; then xz -dc "$1" >"$2"
  else "$PY" -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"), 1 << 24)' "$1" "$2"; fi
}
record_check() {  # every member of the wheel against its RECORD
  "$PY" - "$1" <<'EOF'
import base64, hashlib, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
rec = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")][0]
listed, bad = {}, []
for line in z.read(rec).decode().splitlines():
    path, h, _ = line.rsplit(",", 2)
    listed[path] = h
for name in z.namelist():
    if name.endswith("/"):
        continue
    h = listed.get(name)
    if name == rec:
        continue
    if not h:
        bad.append(name + " (not in RECORD)"); continue
    algo, want = h.split("=", 1)
    got = base64.urlsafe_b64encode(hashlib.new(algo, z.read(name)).digest()).rstrip(b"=").decode()
    if got != want:
        bad.append(name)
missing = [p for p in listed if p not in z.namelist()]
if bad or missing:
    print("RECORD mismatch:", bad[:5], "missing:", missing[:5]); sys.exit(1)
EOF
}

ok_wheels=() ; declare -A group_ok=([tilelang]=1 [cute]=1)
while read -r group whl xzsha whlsha pypisha; do
  [ -z "${group:-}" ] && continue
  out=$WORK/$whl
  if [ -f "$out" ] && [ "$(sha "$out")" = "$whlsha" ]; then
    echo "ok (already) $whl"; ok_wheels+=("$out"); continue
  fi
  if [ -f "$CARRIED/$whl.xz" ]; then parts=("$CARRIED/$whl.xz")
  else mapfile -t parts < <(ls "$CARRIED/$whl.xz.part-"* 2>/dev/null | LC_ALL=C sort); fi
  if [ ${#parts[@]} -eq 0 ]; then echo "MISSING $whl (its bundle was not carried)"; group_ok[$group]=0; continue; fi
  cat "${parts[@]}" >"$out.xz"
  if [ "$(sha "$out.xz")" != "$xzsha" ]; then
    echo "BAD sha256 of $whl.xz from ${#parts[@]} part(s) (a part missing or damaged)"; group_ok[$group]=0; rm -f "$out.xz"; continue
  fi
  unxz_to "$out.xz" "$out" && rm -f "$out.xz"
  if [ "$(sha "$out")" != "$whlsha" ]; then echo "BAD sha256 of $whl"; group_ok[$group]=0; continue; fi
  if ! record_check "$out"; then echo "BAD RECORD of $whl"; group_ok[$group]=0; continue; fi
  echo "ok $whl (${#parts[@]} part(s); sha256 and RECORD verified)"
  ok_wheels+=("$out")
done <<<"$MANIFEST"

[ ${#ok_wheels[@]} -eq 0 ] && { echo "nothing to install from $CARRIED"; exit 2; }
"$PY" -m pip install -q --disable-pip-version-check --no-warn-script-location \
  --no-deps --no-index --upgrade --target "$TARGET" "${ok_wheels[@]}" || { echo "pip install failed"; exit 3; }
echo "export PYTHONPATH=$TARGET:$TARGET/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}" >"$TARGET/env.sh"
export PYTHONPATH=$TARGET:$TARGET/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}

echo "nvcc: $(command -v nvcc || echo 'NOT on PATH (TileLang compiles with it: export PATH=/usr/local/cuda/bin:$PATH)')"
status=0
if [ "${group_ok[tilelang]}" = 1 ]; then
  "$PY" -c 'import tilelang; print("import tilelang: OK", tilelang.__version__)' 2>&1 | tail -3 || status=1
fi
if [ "${group_ok[cute]}" = 1 ]; then
  "$PY" -c 'import cutlass, cutlass.cute, cutlass._mlir._mlir_libs._cutlass_ir as m; print("import cutlass.cute: OK, CUDA flavor", cutlass.CUDA_VERSION, m.__file__.rsplit("/",1)[-1])' 2>&1 | tail -3 || status=1
fi
if [ "${group_ok[tilelang]}" = 1 ] && [ "${group_ok[cute]}" = 1 ]; then
  "$PY" -c 'import cutlass.cute, tilelang' 2>&1 | tail -3 && echo "python3 -c 'import cutlass.cute, tilelang': OK" \
    || { echo "python3 -c 'import cutlass.cute, tilelang': FAILED"; status=1; }
else
  echo "not complete: tilelang=${group_ok[tilelang]} cute=${group_ok[cute]} (1 = all its wheels installed)"; status=4
fi
echo "then: . $TARGET/env.sh"
exit $status
