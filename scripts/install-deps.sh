#!/usr/bin/env bash
# Installs the Debian packages dbuf needs to build and test. Idempotent: only
# missing packages are installed, and apt-get update runs only when needed.
set -euo pipefail

PACKAGES=(
  build-essential cmake make pkg-config
  nlohmann-json3-dev libgtest-dev libcli11-dev
  libtomlplusplus-dev libspdlog-dev libasio-dev libboost-dev
  libgloo-dev libhiredis-dev redis-server iproute2
  python3
  dpkg-dev file systemd util-linux  # cpack -G DEB and tests/install (dpkg-shlibdeps, systemd-analyze, unshare)
  prometheus-cpp-dev prometheus
  clang-14 libclang-rt-14-dev llvm-14
  fortunes
  nodejs
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all packages present"
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  echo "install-deps: missing packages: ${missing[*]}; run as root (or install them) first" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
