#!/usr/bin/env bash
# The container image, built from the Dockerfile and run (`make e2e` runs this first):
#  1. scripts/ensure-container-tools.sh installs podman, runc and debootstrap (root, apt-get);
#  2. the base image: $EPD_CONTAINER_BASE when given (e.g. python:3.11-slim where its registry
#     is reachable), else localhost/epd-base:bookworm, made once from Debian bookworm packages
#     (debootstrap: python3 3.11, python3-venv) and kept in podman's storage for the next runs
#     (EPD_CONTAINER_REBUILD_BASE=1 makes it again);
#  3. pytest runs tests/test_container.py (marker `container`): it builds the image, starts it
#     on a loopback port in front of its embedded simulated cluster, sends a chat request
#     through it, and stops and removes the container and the image.
# Exit code: pytest's; a test skipped for want of the tools is a failure here.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
cd "$REPO"
PY=${PY:-$REPO/.venv/bin/python}
t0=$(date +%s)

bash scripts/ensure-container-tools.sh
command -v podman >/dev/null 2>&1 || { echo "container: podman is not installed" >&2; exit 1; }

BASE=${EPD_CONTAINER_BASE:-localhost/epd-base:bookworm}
if [ -z "${EPD_CONTAINER_BASE:-}" ] \
   && { [ "${EPD_CONTAINER_REBUILD_BASE:-0}" = 1 ] || ! podman image exists "$BASE"; }; then
    [ "$(id -u)" -eq 0 ] || { echo "container: making the base image needs root (debootstrap)" >&2; exit 1; }
    root=$(mktemp -d "${TMPDIR:-/tmp}/epd-base.XXXXXX")
    trap 'rm -rf "$root"' EXIT
    echo "container: making $BASE from Debian bookworm packages" >&2
    if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$root.log" 2>&1; then
        tail -20 "$root.log" >&2; rm -f "$root.log"
        echo "container: debootstrap failed" >&2; exit 1
    fi
    rm -f "$root.log"
    chroot "$root" python3 -c 'import sys, venv; assert sys.version_info >= (3, 11), sys.version' \
        || { echo "container: the base's python3 is older than 3.11" >&2; exit 1; }
    # The base trusts the certificate authorities this machine trusts (a TLS-intercepting
    # proxy's CA, say), so that pip in the build reaches the package index as the host does.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
        chroot "$root" update-ca-certificates >/dev/null
    fi
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    podman rmi -f "$BASE" >/dev/null 2>&1
    tar -C "$root" -c . | podman import --quiet - "$BASE" >/dev/null \
        || { echo "container: podman import failed" >&2; exit 1; }
    rm -rf "$root"; trap - EXIT
fi
t1=$(date +%s)
echo "container: base image $BASE ready after $((t1 - t0))s" >&2

export EPD_CONTAINER_BASE=$BASE EPD_CONTAINER_REQUIRE=1
"$PY" -m pytest -m container tests/test_container.py -p no:cacheprovider -q -rfEs "$@"
rc=$?
echo "container: pytest exited $rc after $(( $(date +%s) - t1 ))s (total $(( $(date +%s) - t0 ))s)" >&2
[ "$rc" -eq 5 ] && { echo "container: no tests were collected: that is a failure here" >&2; exit 1; }
exit "$rc"
