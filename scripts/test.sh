#!/usr/bin/env bash
# The whole test suite on a fresh machine: fetches what the tests need into the cache, without
# root, then runs `cargo nextest run --workspace` (extra arguments go to nextest: a test's name
# to run only the tests whose names contain it, `--profile ci` as CI does).
#   STRATA_LONG=1 also runs the long tests (`long_*`: the 10-minute chaos soak and the other
#   runs made by hand when an issue needs their figures).
#   - the real models (scripts/fetch-model.sh, checksummed, cached);
#   - etcd (the registry tests start real ones) and promtool (checks /metrics): the ones on the
#     PATH, else Debian's packages (etcd-server, prometheus) fetched with `apt-get download` and
#     unpacked under ~/.cache/strata/tools; ETCD_BIN and STRATA_PROMTOOL name other binaries.
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${STRATA_CACHE:-$HOME/.cache/strata}"
tools="$cache/tools"

echo "== models" >&2
for name in $(scripts/fetch-model.sh --list); do
  scripts/fetch-model.sh "$name" >&2
done

# tool BIN PACKAGE: prints the path of BIN, from the PATH or from Debian's PACKAGE unpacked in
# the cache (fetched once; no root needed, `apt-get download` writes into the current folder).
tool() {
  local bin=$1 package=$2
  if command -v "$bin" >/dev/null; then
    command -v "$bin"
    return
  fi
  local dir="$tools/$package"
  if [ ! -x "$dir/usr/bin/$bin" ]; then
    echo "== fetching Debian's $package for $bin (into $dir)" >&2
    local tmp
    tmp=$(mktemp -d)
    if ! (cd "$tmp" && apt-get download "$package" >&2); then
      if [ "$(id -u)" = 0 ]; then
        apt-get update >&2 && (cd "$tmp" && apt-get download "$package" >&2)
      else
        echo "cannot fetch $package: run 'sudo apt-get update' once, or set the binary's variable" >&2
        exit 1
      fi
    fi
    rm -rf "$dir"
    mkdir -p "$dir"
    dpkg-deb -x "$tmp"/"$package"_*.deb "$dir"
    rm -rf "$tmp"
  fi
  "$dir/usr/bin/$bin" --version >/dev/null
  echo "$dir/usr/bin/$bin"
}

ETCD_BIN="${ETCD_BIN:-$(tool etcd etcd-server)}"
STRATA_PROMTOOL="${STRATA_PROMTOOL:-$(tool promtool prometheus)}"
export ETCD_BIN STRATA_PROMTOOL

# cargo-nextest runs each test in its own process with a time limit and prints its time
# (.config/nextest.toml); installed from crates.io when missing (once, a few minutes).
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "== installing cargo-nextest (cargo install --locked cargo-nextest)" >&2
  cargo install --locked cargo-nextest >&2
fi
long=()
[ "${STRATA_LONG:-0}" = 1 ] && long=(--ignore-default-filter)
echo "== tests (etcd: $ETCD_BIN, promtool: $STRATA_PROMTOOL)" >&2
exec cargo nextest run --workspace "${long[@]}" "$@"
