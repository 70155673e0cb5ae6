#!/usr/bin/env bash
# Creates the virtual environment .venv at the repository root with the pinned
# packages of python/requirements.txt (and requirements-nodeps.txt), using the python3 on PATH. Idempotent
# and fast when up to date: .venv/.requirements.sha256 holds the hash of the
# requirements.txt last installed, and pip runs only when that file changed
# (or the environment is missing or broken). When `python3 -m venv` fails for
# want of ensurepip (Debian's python3 without python3-venv), installs
# python3-venv with apt-get if run as root.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
requirements="$root/python/requirements.txt"
requirements_nodeps="$root/python/requirements-nodeps.txt"  # installed with --no-deps
stamp="$venv/.requirements.sha256"

want=$(cat "$requirements" "$requirements_nodeps" | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c '' 2>/dev/null; then
  echo "python-env: $venv is up to date with python/requirements.txt"
  exit 0
fi

create_venv() {
  python3 -m venv --clear "$venv"
}

if ! "$venv/bin/python" -c '' 2>/dev/null; then
  echo "python-env: creating $venv with $(command -v python3) ($(python3 --version))"
  if ! create_venv; then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
      echo "python-env: python3 -m venv failed; install python3-venv (Debian) as root first" >&2
      exit 1
    fi
    echo "python-env: python3 -m venv failed; installing python3-venv"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3-venv
    create_venv
  fi
fi

echo "python-env: installing python/requirements.txt into $venv"
"$venv/bin/python" -m pip install --disable-pip-version-check -q -r "$requirements"
"$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps -r "$requirements_nodeps"
echo "$want" >"$stamp"
echo "python-env: $venv ready ($("$venv/bin/python" --version))"
