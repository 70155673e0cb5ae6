#!/usr/bin/env bash
# gpu_bundle_test.sh BUILD_DIR WORK_DIR: `make gpu-bundle`'s packing
# (scripts/make_gpu_bundle.sh) on this build fits what a device run carries
# (at most 48 MiB as it travels), and the bundle, copied elsewhere as a run
# copies it, unpacks itself and is whole (`run --check`: every gpu-labelled
# test executable and dbufd start, from the bundle's own lib/). Skips (77) a
# build without the CUDA backend: it has no gpu tests to pack.
set -euo pipefail
(($# == 2)) || {
  echo "usage: $0 BUILD_DIR WORK_DIR" >&2
  exit 2
}
BUILD_DIR=$1
WORK=$2
SOURCE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
LIMIT_KIB=$((48 * 1024))

gpu_exes=$(ctest --test-dir "$BUILD_DIR" -L gpu --show-only=json-v1 | python3 -c '
import json, sys
print(len({t["command"][0] for t in json.load(sys.stdin).get("tests", []) if t.get("command")}))')
if ((gpu_exes == 0)); then
  echo "SKIPPED: $BUILD_DIR has no gpu-labelled tests (built without the CUDA backend)"
  exit 77
fi

rm -rf "$WORK"
mkdir -p "$WORK"
"$SOURCE_DIR/scripts/make_gpu_bundle.sh" "$BUILD_DIR" "$WORK/gpu-bundle"

travelling_kib=$(du -sk "$WORK/gpu-bundle" | cut -f1)
echo "gpu bundle: ${travelling_kib} KiB as it travels (limit ${LIMIT_KIB} KiB)"
((travelling_kib <= LIMIT_KIB)) || {
  echo "FAIL: the gpu bundle is ${travelling_kib} KiB, over 48 MiB" >&2
  exit 1
}
listed=$(ls "$WORK/gpu-bundle")
[[ "$listed" == $'README.txt\npayload.tar.xz\nrun' ]] || {
  echo "FAIL: the bundle travels with more than run, README.txt and payload.tar.xz: $listed" >&2
  exit 1
}

# As a device run gets it: the folder copied somewhere else, run from there.
cp -r "$WORK/gpu-bundle" "$WORK/copied"
check=$("$WORK/copied/run" --check)
echo "$check"
[[ "$check" == "run --check: $gpu_exes test executables and dbufd start from $WORK/copied/unpacked/gpu-bundle" ]] || {
  echo "FAIL: expected all $gpu_exes gpu test executables checked in $WORK/copied/unpacked" >&2
  exit 1
}
# A second run finds the payload unpacked already and does not unpack it again.
touch -d '2000-01-01' "$WORK/copied/unpacked/gpu-bundle/run"
"$WORK/copied/run" --check >/dev/null
[[ "$(stat -c %Y "$WORK/copied/unpacked/gpu-bundle/run")" == "$(date -d 2000-01-01 +%s)" ]] || {
  echo "FAIL: the second run unpacked the payload again" >&2
  exit 1
}
echo PASS
rm -rf "$WORK"
