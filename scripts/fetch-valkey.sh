#!/usr/bin/env bash
# Fetches a Valkey server binary for the tests that run the conformance suite on Valkey
# (SPEC §7: the redis store works against Redis 7 and Valkey). Debian packages Valkey from
# trixie on and in bookworm-backports; this downloads the `valkey-tools` package from the
# machine's own suite or its backports with a private apt state (the system's sources and
# package lists are left as they are), unpacks it under .valkey/ and installs nothing.
# Prints the path of the server binary.
#
#   scripts/fetch-valkey.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.valkey
BIN="$DEST/valkey-server"
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  echo "$PWD/$BIN"
  exit 0
fi
. /etc/os-release
codename=${VERSION_CODENAME:?/etc/os-release names no Debian codename}
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
printf 'deb http://deb.debian.org/debian %s main\ndeb http://deb.debian.org/debian %s-backports main\n' \
  "$codename" "$codename" > "$state/sources.list"
apt_private() {
  apt-get -qq -o Dir::State::Lists="$state/lists" -o Dir::Cache="$state/cache" \
    -o Dir::Etc::sourcelist="$state/sources.list" -o Dir::Etc::sourceparts=- \
    -o APT::Sandbox::User=root "$@"
}
apt_private update >&2
(cd "$state" && apt_private download valkey-tools >&2)
deb=$(ls "$state"/valkey-tools_*.deb)
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
dpkg-deb -x "$deb" "$DEST.tmp/root"
# Debian ships the server as a link to this binary (it acts on the name it is run as).
cp "$DEST.tmp/root/usr/bin/valkey-check-rdb" "$DEST.tmp/valkey-server"
rm -rf "$DEST.tmp/root" "$DEST" && mv "$DEST.tmp" "$DEST"
if ! "$BIN" --version >&2; then
  echo "valkey-server does not run here; missing libraries:" >&2
  ldd "$BIN" | grep 'not found' >&2 || true
  exit 1
fi
echo "$PWD/$BIN"
