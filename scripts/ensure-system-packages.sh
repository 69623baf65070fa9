#!/usr/bin/env bash
# System programs the test suite starts as real servers or runs as checkers, installed with
# apt-get when missing and this user may install them; otherwise the tests that need them are
# skipped with the reason:
#   dnsmasq       a DNS server for the DNS-discovery tests
#   redis-server  the shared state store's and the shared rate-limit counters' tests (valkey-server is taken where it is installed)
#   promtool      (Debian's prometheus package) the exposition format and the alert rules
#   valgrind      the instruction counts of `make instructions-check`
#   chromium      headless: the console's page as a browser shows it (tests/api/test_console_browser.py)
set -u
missing=()
command -v dnsmasq >/dev/null 2>&1 || [ -x /usr/sbin/dnsmasq ] || missing+=(dnsmasq)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v valgrind >/dev/null 2>&1 || missing+=(valgrind)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || missing+=(redis-server)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: ${missing[*]} not installed (needs root and apt-get); the tests that use it will be skipped" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
        || echo "note: could not install ${missing[*]}; the tests that use it will be skipped" >&2
fi
exit 0
