#!/usr/bin/env bash
# Several "hosts" on one machine, for real multi-host runs without several machines.
#
#   scripts/hosts.sh up N RATE [DELAY]   N network namespaces PREFIX-h0 .. PREFIX-h(N-1), each with
#                                        its own network stack: loopback, and an interface eth0
#                                        with address SUBNET.1, SUBNET.2, ... joined by a veth
#                                        pair to one bridge PREFIX-br; each host's link limited
#                                        to RATE in each direction (tc tbf, e.g. 100mbit, 1gbit;
#                                        "none" for no limit), plus DELAY one way (tc netem, e.g.
#                                        5ms) where the kernel has netem -- else a warning, and
#                                        no delay
#   scripts/hosts.sh down                removes everything `up` made; safe to run twice
#   scripts/hosts.sh status              the hosts, their addresses and queueing disciplines
#   scripts/hosts.sh exec I CMD ...      runs CMD in host I (ip netns exec PREFIX-hI CMD ...)
#
# Environment: DTRAIN_HOSTS_PREFIX (default "dtrain"; letters and digits, at most 10) names
# everything this script makes, so that two sets can coexist; DTRAIN_HOSTS_SUBNET (default
# "10.77.0", the first three octets of a /24). The bridge has no address: the hosts reach each
# other, never the machine's own network or anything beyond it. Needs root, `ip` and `tc`.
# tests.hosts drives this script from Python (tests, benchmarks).

set -Eeuo pipefail # -E: the ERR trap of `up` also fires inside functions

PREFIX="${DTRAIN_HOSTS_PREFIX:-dtrain}"
SUBNET="${DTRAIN_HOSTS_SUBNET:-10.77.0}"
BRIDGE="${PREFIX}-br"

die() {
    echo "hosts.sh: error: $*" >&2
    exit 2
}

warn() {
    echo "hosts.sh: warning: $*" >&2
}

usage() {
    echo "usage: $0 up N RATE [DELAY] | down | status | exec I CMD ..." >&2
    exit 2
}

check_tools() {
    [[ "$(id -u)" == 0 ]] || die "needs root (network namespaces, veth pairs and tc)"
    command -v ip >/dev/null || die "needs the 'ip' command (iproute2)"
    command -v tc >/dev/null || die "needs the 'tc' command (iproute2)"
}

check_names() {
    [[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,9}$ ]] ||
        die "DTRAIN_HOSTS_PREFIX='$PREFIX': letters and digits, starting with a letter, at most 10"
    [[ "$SUBNET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] ||
        die "DTRAIN_HOSTS_SUBNET='$SUBNET': the first three octets of a /24, e.g. 10.77.0"
}

# Bytes per second of a tc rate (bit, kbit, mbit, gbit, tbit; bps, kbps, mbps, gbps), or fail.
rate_bytes() {
    local rate="${1,,}" number unit
    [[ "$rate" =~ ^([0-9]+)([a-z]*)$ ]] || return 1
    number="${BASH_REMATCH[1]}"
    unit="${BASH_REMATCH[2]}"
    case "$unit" in
        "" | bit) echo $((number / 8)) ;;
        kbit) echo $((number * 1000 / 8)) ;;
        mbit) echo $((number * 1000000 / 8)) ;;
        gbit) echo $((number * 1000000000 / 8)) ;;
        tbit) echo $((number * 1000000000000 / 8)) ;;
        bps) echo "$number" ;;
        kbps) echo $((number * 1000)) ;;
        mbps) echo $((number * 1000000)) ;;
        gbps) echo $((number * 1000000000)) ;;
        *) return 1 ;;
    esac
}

# Our namespaces and links, whatever N they were made with.
our_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-h[0-9]+$" || true
}

our_links() {
    ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' |
        grep -E "^${PREFIX}-(v[0-9]+|p[0-9]+|br)$" || true
}

down() {
    local name
    # The veth first (deleting one end deletes its peer inside the namespace), then the
    # namespaces, then the bridge: a namespace's own teardown is asynchronous in the kernel.
    for name in $(our_links); do
        [[ "$name" == "$BRIDGE" ]] || ip link del "$name" 2>/dev/null || true
    done
    for name in $(our_namespaces); do
        ip netns del "$name" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    local tries=0
    while [[ -n "$(our_links)$(our_namespaces)" ]]; do
        tries=$((tries + 1))
        if ((tries > 50)); then
            die "could not remove: $(our_links | tr '\n' ' ')$(our_namespaces | tr '\n' ' ')"
        fi
        sleep 0.1
    done
}

# shape DEV_ARGS...: the rate limit (and delay) on one end of a host's link. Egress only, as
# tc shapes: limiting both ends limits what a host sends and what it receives, each at RATE,
# as a full-duplex network card does.
shape() {
    local -a dev=("$@")
    [[ "$RATE" == none ]] && [[ -z "$DELAY" ]] && return 0
    local -a tbf=()
    if [[ "$RATE" != none ]]; then
        # burst: 10 ms at the rate, and at least one 64 KiB segment of the veth's offloads;
        # latency: how long a packet may queue before it is dropped (a switch's buffer).
        local burst=$((RATE_BYTES / 100))
        ((burst < 65536)) && burst=65536
        tbf=(tbf rate "$RATE" burst "$burst" latency 50ms)
    fi
    if [[ -n "$DELAY" ]]; then
        tc "${dev[@]}" root handle 1: netem delay "$DELAY"
        if ((${#tbf[@]})); then
            tc "${dev[@]}" parent 1:1 handle 10: "${tbf[@]}"
        fi
    else
        tc "${dev[@]}" root "${tbf[@]}"
    fi
}

up() {
    local n="$1"
    if ! [[ "$n" =~ ^[0-9]+$ ]] || ((n < 1 || n > 250)); then
        die "N='$n': a number of hosts, 1 to 250"
    fi
    if [[ "$RATE" != none ]]; then
        RATE_BYTES="$(rate_bytes "$RATE" || echo 0)"
        if ((RATE_BYTES <= 0)); then
            die "RATE='$RATE': a tc rate such as 100mbit, 1gbit or 10gbit, or none"
        fi
    fi
    if [[ -n "$(our_links)$(our_namespaces)" ]]; then
        die "hosts named ${PREFIX}-* exist already: run '$0 down' first (or set DTRAIN_HOSTS_PREFIX)"
    fi
    # From here on, a failed step removes what was made before it.
    trap 'echo "hosts.sh: error: a step failed; removing what was made" >&2; down' ERR

    if [[ -n "$DELAY" ]]; then
        # netem may be missing from the kernel (sch_netem): probe it once on a scratch link.
        local probe="${PREFIX}-p999"
        ip link add "$probe" type veth peer name "${PREFIX}-v999"
        if ! tc qdisc add dev "$probe" root netem delay "$DELAY" 2>/dev/null; then
            warn "tc netem is not available in this kernel (or DELAY='$DELAY' is not a" \
                "delay): going on without delay; only the rate is limited"
            DELAY=""
        fi
        ip link del "$probe"
    fi

    ip link add "$BRIDGE" type bridge
    ip link set "$BRIDGE" up
    local i ns
    for ((i = 0; i < n; i++)); do
        ns="${PREFIX}-h${i}"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip link add "${PREFIX}-v${i}" type veth peer name "${PREFIX}-p${i}"
        ip link set "${PREFIX}-p${i}" netns "$ns"
        ip -n "$ns" link set "${PREFIX}-p${i}" name eth0
        ip -n "$ns" addr add "${SUBNET}.$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip link set "${PREFIX}-v${i}" master "$BRIDGE"
        ip link set "${PREFIX}-v${i}" up
        shape -n "$ns" qdisc add dev eth0         # what host i sends
        shape qdisc add dev "${PREFIX}-v${i}"     # what host i receives
    done
    trap - ERR
    local limit="rate ${RATE}"
    [[ "$RATE" == none ]] && limit="no rate limit"
    [[ -n "$DELAY" ]] && limit="${limit}, delay ${DELAY} each way"
    echo "hosts.sh: ${n} host(s) up (${limit}):"
    for ((i = 0; i < n; i++)); do
        echo "  ${PREFIX}-h${i}  eth0 ${SUBNET}.$((i + 1))"
    done
    echo "run a command in host I: ip netns exec ${PREFIX}-hI CMD  (or: $0 exec I CMD)"
}

status() {
    local ns
    for ns in $(our_namespaces); do
        echo "$ns: $(ip -n "$ns" -o -4 addr show dev eth0 2>/dev/null | awk '{print $4}')"
        tc -n "$ns" qdisc show dev eth0 2>/dev/null | sed 's/^/  send: /'
        tc qdisc show dev "${PREFIX}-v${ns##*-h}" 2>/dev/null | sed 's/^/  receive: /'
    done
}

main() {
    (($# >= 1)) || usage
    local command="$1"
    shift
    check_names
    case "$command" in
        up)
            (($# == 2 || $# == 3)) || usage
            check_tools
            RATE="${2,,}"
            DELAY="${3:-}"
            up "$1"
            ;;
        down)
            (($# <= 1)) || usage # a count may follow, as for up; everything named ours goes
            check_tools
            down
            ;;
        status)
            check_tools
            status
            ;;
        exec)
            (($# >= 2)) || usage
            [[ "$1" =~ ^[0-9]+$ ]] || die "host '$1': a number, 0 to N-1"
            check_tools
            local ns="${PREFIX}-h$1"
            shift
            exec ip netns exec "$ns" "$@"
            ;;
        *) usage ;;
    esac
}

RATE=none
RATE_BYTES=0
DELAY=""
main "$@"
