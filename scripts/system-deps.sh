#!/usr/bin/env bash
# System programs some tests start for real: Debian's redis-server (the Redis KV tier's tests) and
# prometheus (the scrape test). Serving and the SDK need neither; `make test` runs this, `make serve` does not.
#
# As root with apt-get, installs what is missing, without starting the packages' services (a policy-rc.d
# refuses their start during the install; the tests start their own servers on free loopback ports).
# Otherwise it prints one line saying what to install, and the tests that need a missing program skip.
# It never stops or kills a process: a Redis or Prometheus already running is left alone.
set -u
missing=()
for program in redis-server prometheus; do
    command -v "$program" >/dev/null 2>&1 || missing+=("$program")
done
[ ${#missing[@]} -eq 0 ] && exit 0

install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1
}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: installing ${missing[*]} with apt-get"
    policy=/usr/sbin/policy-rc.d
    if [ ! -e "$policy" ]; then
        # Debian's maintainer scripts ask this file before starting a service: 101 means "not now".
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
        trap 'rm -f "$policy"' EXIT
    fi
    if install || { apt-get update -q >/dev/null 2>&1 && install; }; then
        exit 0
    fi
fi
echo "system-deps: ${missing[*]} not installed; the tests that need them will skip." \
     "To run them: sudo apt-get install ${missing[*]} (Debian/Ubuntu), or put the programs on PATH." >&2
exit 0
