#!/usr/bin/env bash
# System services the tiers, the deployment tests and the benchmarks start for real:
# Debian's redis-server (the Redis KV tier) and prometheus (the scrape test).
# Installs what is missing with apt-get when run as root; otherwise says what to install.
set -u
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: installing ${missing[*]} with apt-get"
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }; then
        # The Debian packages start their services; the project starts its own on loopback.
        for svc in redis-server prometheus; do
            command -v systemctl >/dev/null 2>&1 && systemctl stop "$svc" >/dev/null 2>&1
            pkill -x "$svc" >/dev/null 2>&1
        done
        exit 0
    fi
fi
echo "system-deps: could not install ${missing[*]}." >&2
echo "  Install them yourself (Debian/Ubuntu: sudo apt-get install redis-server prometheus)." >&2
echo "  Without redis-server the Redis tier cannot be used and its tests fail;" >&2
echo "  without prometheus the scrape test fails." >&2
exit 1
