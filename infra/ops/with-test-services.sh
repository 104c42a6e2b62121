#!/usr/bin/env bash
# Runs a command (the test suite) with what the team-setup tests need on this kind of machine
# (Debian, root): Debian's Chromium for the browser test and PostgreSQL on 127.0.0.1:5432.
# Installs / starts only what is missing, and stops afterwards only what it started.
set -euo pipefail

if ! command -v chromium >/dev/null; then
    echo "test-services: installing Debian's chromium"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi

started_postgres=""
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    cluster="$(ls /etc/postgresql)"
    echo "test-services: starting PostgreSQL $cluster"
    pg_ctlcluster --skip-systemctl-redirect "$cluster" main start
    started_postgres="$cluster"
    for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
stop_postgres() {
    if [ -n "$started_postgres" ]; then
        echo "test-services: stopping PostgreSQL $started_postgres"
        pg_ctlcluster --skip-systemctl-redirect "$started_postgres" main stop
    fi
}
trap stop_postgres EXIT

"$@"
