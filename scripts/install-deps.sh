#!/usr/bin/env bash
# Installs everything psx builds, tests and benchmarks with, from Debian 12's
# packages. Run as root (or with sudo) on Debian 12 or newer.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
packages=(
  cmake ninja-build g++ ccache git           # toolchain
  libeigen3-dev libxtensor-dev               # tensor adapters (psx/eigen.hpp, psx/xtensor.hpp)
  libzmq3-dev cppzmq-dev rapidjson-dev       # ZeroMQ transport, TF_CONFIG parsing
  libcereal-dev                              # checkpoints and exports
  doctest-dev libbenchmark-dev               # tests and microbenchmarks
  util-linux procps iproute2 python3         # test tools: taskset, ps/pgrep, ip/ss (two-host
                                             # test), python3 (psx-launch --spec)
  gnuplot-nox                                # psx-bench draws its loss-vs-time plot (PNG)
  python3-numpy python3-pip                  # the export test reads .npz with numpy.load (and
                                             # .safetensors with the PyPI package, when it installs)
)
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
