#!/usr/bin/env bash
# The GPU bundle as it travels: gpu-bundle/run (this script), README.txt and
# payload.tar.xz, the bundle itself packed (its binaries are ~60 MB, over
# what a device run carries; packed, ~8 MB). Unpacks the payload once, next
# to this script (or, where that is read-only, into a new folder under $TMPDIR
# at each run; two runs of one bundle at once are not supported), then runs the
# unpacked runner (scripts/gpu_bundle_run.sh) with the same arguments:
#
#   gpu-bundle/run [RESULTS_DIR]     # every GPU test and benchmark
#   gpu-bundle/run --check           # the bundle is whole; runs nothing
#
# Unpacks with tar and xz where the machine has them, else with python3's
# tarfile (a GPU machine's image may lack xz-utils).
set -euo pipefail

HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd -P)
PAYLOAD="$HERE/payload.tar.xz"
[[ -f "$PAYLOAD" ]] || {
  echo "run: $PAYLOAD is missing: copy the whole gpu-bundle folder (make gpu-bundle makes it)" >&2
  exit 1
}
if command -v xz >/dev/null && command -v tar >/dev/null; then
  unpack_with=tar
elif command -v python3 >/dev/null; then
  unpack_with=python3
else
  echo "run: cannot unpack $PAYLOAD: neither tar with xz nor python3 is installed" >&2
  exit 1
fi
payload_id=$(cksum <"$PAYLOAD" | cut -d' ' -f1)

# unpack_into DIR: DIR/gpu-bundle is the payload's tree, unpacked at most once per payload.
unpack_into() {
  local dir=$1
  local stamp="$dir/.payload-cksum"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$payload_id" && -x "$dir/gpu-bundle/run" ]]; then
    return 0
  fi
  mkdir -p "$dir" 2>/dev/null && [[ -w "$dir" ]] || return 1
  rm -rf "$dir/gpu-bundle" "$stamp"
  if [[ $unpack_with == tar ]]; then
    tar -xJf "$PAYLOAD" -C "$dir" || return 1
  else
    python3 - "$PAYLOAD" "$dir" <<'PY' || return 1
import sys, tarfile
with tarfile.open(sys.argv[1]) as archive:
    if hasattr(tarfile, "data_filter"):
        archive.extractall(sys.argv[2], filter="data")
    else:
        archive.extractall(sys.argv[2])
PY
  fi
  echo "$payload_id" >"$stamp"
}

unpacked="$HERE/unpacked"
if ! unpack_into "$unpacked"; then
  # A folder of this run's own (mktemp: no other user can have planted one), unpacked each time.
  unpacked=$(mktemp -d "${TMPDIR:-/tmp}/dbuf-gpu-bundle.XXXXXX") && unpack_into "$unpacked" || {
    echo "run: cannot unpack $PAYLOAD into $HERE/unpacked nor under ${TMPDIR:-/tmp}" >&2
    exit 1
  }
fi
exec "$unpacked/gpu-bundle/run" "$@"
