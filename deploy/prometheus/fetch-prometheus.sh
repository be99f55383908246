#!/bin/sh
# Debian's prometheus package (prometheus + promtool, static Go binaries) unpacked under DEST without installing
# it: `apt-get download` + `dpkg -x`; `apt-get update` once if the package lists lack it. Used by `make
# prometheus` and by tests/live/test_metrics_live.py. Prints the bin folder.
set -eu
dest=$(realpath -m "${1:-build/tools/prometheus}")
if [ -x "$dest/usr/bin/prometheus" ] && [ -x "$dest/usr/bin/promtool" ]; then
  echo "$dest/usr/bin"; exit 0
fi
command -v apt-get >/dev/null && command -v dpkg >/dev/null || { echo "apt-get/dpkg not found: not a Debian system" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
if ! apt-get download prometheus >/dev/null 2>&1; then
  apt-get update >/dev/null 2>&1 || true
  apt-get download prometheus >&2
fi
mkdir -p "$dest.part"
dpkg -x prometheus_*.deb "$dest.part"
rm -rf "$dest" && mv "$dest.part" "$dest"
"$dest/usr/bin/prometheus" --version >&2
echo "$dest/usr/bin"
