#!/usr/bin/env bash
# The programs e2e/container.sh builds and runs the image with, from Debian packages:
# podman (build and run), runc (the OCI runtime it is run with: crun refuses hosts whose
# cgroup v2 hierarchy holds controllers beside cgroup v1, runc does not) and debootstrap
# (a Debian bookworm base image made from Debian packages, for machines that cannot pull
# python:3.11-slim). Installed with apt-get when missing and this user may install them;
# otherwise the container test is skipped with the reason.
set -u
missing=()
command -v podman >/dev/null 2>&1 || missing+=(podman)
command -v runc >/dev/null 2>&1 || missing+=(runc)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: ${missing[*]} not installed (needs root and apt-get); the container test will be skipped" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
        || echo "note: could not install ${missing[*]}; the container test will be skipped" >&2
fi
exit 0
