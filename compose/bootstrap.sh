#!/usr/bin/env bash
# Installs what the local stack needs: Debian packages (Podman, runc, catatonit, static busybox,
# PostgreSQL 15, Java 17, Maven; mmdebstrap for the image's Debian base; Chromium for the
# console's browser tests; containerd and the CNI plugins for the local cluster's real node; the
# packages CRIU 4.1 is built with, services/localstack/criu_build.py) and the project's virtualenv (.venv, `pip install -e '.[dev]'`).
# Idempotent and fast when everything is present: apt-get runs only for missing packages, and
# pip only when pyproject.toml changed since the last install (a stamp file in .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PACKAGES=(podman runc catatonit busybox-static postgresql-15 openjdk-17-jre-headless maven openssl
  mmdebstrap chromium containerd containernetworking-plugins
  build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
  python3-protobuf libnl-3-dev libcap-dev uuid-dev libnet1-dev libbsd-dev)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$pkg")
  fi
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "bootstrap: missing Debian packages (${missing[*]}); rerun as root" >&2
    exit 1
  fi
  echo "bootstrap: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
  echo "bootstrap: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.sandstream-pyproject.sha256
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ ! -f $stamp || "$(cat "$stamp")" != "$want" ]]; then
  echo "bootstrap: pip install -e '.[dev]'"
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$want" >"$stamp"
fi
echo "bootstrap: ok"
