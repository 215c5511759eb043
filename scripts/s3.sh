#!/usr/bin/env bash
# A real object store on this machine, for run folders in S3 (docs/fault-tolerance.md): Debian's
# OpenStack Swift with its S3 API (the s3api middleware, tempauth), one replica, on loopback.
#
#   scripts/s3.sh up       starts Swift's account, container and object servers and its proxy
#                          (S3 API at http://127.0.0.1:PORT), its data under ROOT; creates the
#                          bucket BUCKET; installs the Debian packages when missing (apt-get)
#   scripts/s3.sh down     stops everything `up` started and removes ROOT; safe to run twice
#   scripts/s3.sh status   whether it runs, and the S3 endpoint
#   scripts/s3.sh env      the environment a client needs, as `export` lines:
#                          eval "$(scripts/s3.sh env)"
#
# Environment: DTRAIN_S3_ROOT (default /tmp/dtrain-s3) holds the configs, rings, data, logs
# and pid files; DTRAIN_S3_PORT (default 18480) is the proxy's port, the storage servers take
# the three ports above it, and memcached (which tempauth needs) the fourth; DTRAIN_S3_BUCKET (default "dtrain") the bucket `up` creates. The
# credentials are the fixed test account of tempauth (test:tester / testing): for tests only.
# Swift reads /etc/swift/swift.conf whatever its servers' configs say: `up` writes one when
# there is none (its hash path suffix only), and leaves an existing one as it is. Needs root
# for apt-get and /etc/swift.

set -Eeuo pipefail

ROOT="${DTRAIN_S3_ROOT:-/tmp/dtrain-s3}"
PORT="${DTRAIN_S3_PORT:-18480}"
BUCKET="${DTRAIN_S3_BUCKET:-dtrain}"
ACCESS_KEY="test:tester"
SECRET_KEY="testing"
SERVERS=(memcached account container object proxy)

die() {
    echo "s3.sh: error: $*" >&2
    exit 2
}

say() {
    echo "s3.sh: $*" >&2
}

usage() {
    echo "usage: $0 up | down | status | env" >&2
    exit 2
}

port_of() { # account, container, object: the three ports above the proxy's
    case "$1" in
        account) echo $((PORT + 1)) ;;
        container) echo $((PORT + 2)) ;;
        object) echo $((PORT + 3)) ;;
        memcached) echo $((PORT + 4)) ;;
        proxy) echo "$PORT" ;;
    esac
}

install_packages() {
    command -v swift-proxy-server >/dev/null && command -v swift-object-server >/dev/null &&
        command -v swift-ring-builder >/dev/null && command -v memcached >/dev/null && return 0
    [[ "$(id -u)" == 0 ]] || die "Swift is not installed and installing it needs root"
    local packages=(swift swift-proxy swift-account swift-container swift-object memcached)
    say "installing Debian's Swift (${packages[*]}; 3-4 minutes)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null 2>&1 || {
        apt-get update -qq >/dev/null 2>&1 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null 2>&1
    } || die "apt-get could not install ${packages[*]}"
}

write_configs() {
    mkdir -p "$ROOT/node/d1" "$ROOT/run" "$ROOT/log" "$ROOT/cache"
    if [[ ! -f /etc/swift/swift.conf ]]; then
        mkdir -p /etc/swift
        printf '[swift-hash]\nswift_hash_path_suffix = dtrain-s3-%s\n' "$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')" \
            >/etc/swift/swift.conf
        say "wrote /etc/swift/swift.conf (Swift reads it from there only)"
    fi
    local server
    for server in account container object; do
        cat >"$ROOT/$server-server.conf" <<EOF
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = $(port_of "$server")
devices = $ROOT/node
mount_check = false
swift_dir = $ROOT
user = $(id -un)
workers = 1
log_facility = LOG_LOCAL2
log_name = $server-server
log_address = /nonexistent

[pipeline:main]
pipeline = $server-server

[app:$server-server]
use = egg:swift#$server

[$server-replicator]
[$server-auditor]
[$server-updater]
EOF
    done
    cat >"$ROOT/proxy-server.conf" <<EOF
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = $PORT
swift_dir = $ROOT
user = $(id -un)
workers = 1
log_name = proxy-server
log_address = /nonexistent

[pipeline:main]
pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth copy slo dlo proxy-logging proxy-server

[app:proxy-server]
use = egg:swift#proxy
allow_account_management = true
account_autocreate = true

[filter:s3api]
use = egg:swift#s3api
location = us-east-1

[filter:tempauth]
use = egg:swift#tempauth
user_test_tester = $SECRET_KEY .admin
reseller_prefix = AUTH

[filter:cache]
use = egg:swift#memcache
memcache_servers = 127.0.0.1:$(port_of memcached)

EOF
    local filter # the plain ones, as the pipeline names them: egg:swift#NAME, nothing to set
    for filter in catch_errors gatekeeper healthcheck proxy-logging listing_formats copy slo dlo; do
        printf '[filter:%s]\nuse = egg:swift#%s\n' "$filter" "${filter//-/_}" >>"$ROOT/proxy-server.conf"
    done
}

build_rings() {
    local server
    for server in account container object; do
        [[ -f "$ROOT/$server.ring.gz" ]] && continue
        # 2^8 partitions, one replica, no minimum hours between moves; one device.
        swift-ring-builder "$ROOT/$server.builder" create 8 1 0 >/dev/null
        swift-ring-builder "$ROOT/$server.builder" add \
            "r1z1-127.0.0.1:$(port_of "$server")/d1" 100 >/dev/null
        swift-ring-builder "$ROOT/$server.builder" rebalance >/dev/null || true
    done
}

running() { # server -> its pid, if it runs
    local pidfile="$ROOT/run/$1.pid"
    [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null && cat "$pidfile"
}

start_servers() {
    local server
    for server in "${SERVERS[@]}"; do
        running "$server" >/dev/null && continue
        if [[ "$server" == memcached ]]; then
            memcached -l 127.0.0.1 -p "$(port_of memcached)" -U 0 -m 64 -u "$(id -un)" \
                >"$ROOT/log/$server.log" 2>&1 &
        else # -v: its log to the console, here its log file (there may be no syslog)
            "swift-$server-server" "$ROOT/$server-server.conf" -v >"$ROOT/log/$server.log" 2>&1 &
        fi
        echo $! >"$ROOT/run/$server.pid"
    done
}

wait_ready() {
    local i
    # Each server takes seconds to start on a busy machine.
    for i in $(seq 1 300); do
        if curl -sf "http://127.0.0.1:$PORT/healthcheck" >/dev/null 2>&1; then
            return 0
        fi
        for server in "${SERVERS[@]}"; do
            running "$server" >/dev/null ||
                die "$server stopped: $(tail -3 "$ROOT/log/$server.log" | tr '\n' ' ')"
        done
        sleep 0.2
    done
    die "Swift's proxy did not answer on 127.0.0.1:$PORT in 60 s (logs in $ROOT/log)"
}

print_env() {
    echo "export AWS_ENDPOINT_URL_S3=http://127.0.0.1:$PORT"
    echo "export AWS_ACCESS_KEY_ID=$ACCESS_KEY"
    echo "export AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
    echo "export AWS_DEFAULT_REGION=us-east-1"
    echo "export DTRAIN_S3_BUCKET=$BUCKET"
}

make_bucket() {
    # Through the S3 API itself, with the client dtrain uses.
    eval "$(print_env)"
    "${PYTHON:-python3}" - "$BUCKET" <<'EOF'
import sys

import s3fs

fs = s3fs.S3FileSystem()
if not fs.exists(sys.argv[1]):
    fs.mkdir(sys.argv[1])
EOF
}

cmd_up() {
    install_packages
    write_configs
    build_rings
    start_servers
    wait_ready
    make_bucket
    say "Swift's S3 API at http://127.0.0.1:$PORT, bucket $BUCKET; for a client: eval \"\$($0 env)\""
}

cmd_down() {
    local server pid
    for server in "${SERVERS[@]}"; do
        pid="$(running "$server" || true)"
        [[ -n "$pid" ]] || continue
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    done
    rm -rf "$ROOT"
}

cmd_status() {
    local server pid any=0
    for server in "${SERVERS[@]}"; do
        pid="$(running "$server" || true)"
        if [[ -n "$pid" ]]; then
            echo "$server: running (pid $pid, port $(port_of "$server"))"
            any=1
        else
            echo "$server: not running"
        fi
    done
    [[ "$any" == 1 ]] && echo "S3 endpoint: http://127.0.0.1:$PORT (bucket $BUCKET)"
    return 0
}

[[ $# -ge 1 ]] || usage
case "$1" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) print_env ;;
    *) usage ;;
esac
