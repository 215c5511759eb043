#!/usr/bin/env bash
# A two-node Slurm cluster on one machine, for running dtrain's Slurm recipe for real
# (docs/multi-host.md) without a cluster.
#
#   scripts/slurm.sh up            two hosts in network namespaces (scripts/hosts.sh), a munge
#                                  daemon, slurmctld on host 0, a slurmd on each host (nodes
#                                  n0 and n1, one partition "main"); waits until both nodes are
#                                  idle
#   scripts/slurm.sh down          stops the daemons and removes everything `up` made; safe to
#                                  run twice
#   scripts/slurm.sh status        the daemons, and sinfo
#   scripts/slurm.sh exec CMD ...  runs a Slurm command (sbatch, squeue, scancel, scontrol,
#                                  sinfo) on host 0, with SLURM_CONF set
#
# No systemd and no cgroups: the daemons are started by hand, each in its host's network
# namespace; processes are tracked by parentage (proctrack/linuxproc), tasks are not bound
# (task/none), and slurmd 22.05, which insists on reading a cgroup.conf, is pointed at an empty
# folder with automount off. The hosts share this machine's cores, memory, filesystem and
# process table; the nodes each declare CPUS (default: every core of this machine).
#
# Environment: DTRAIN_SLURM_PREFIX (default "dtslurm"; letters and digits, at most 10) names
# the namespaces and links, DTRAIN_SLURM_SUBNET (default "10.78.0") their addresses,
# DTRAIN_SLURM_DIR (default /tmp/dtrain-slurm-PREFIX) holds the configuration, state, logs
# and the munge key and socket. Needs root, and Debian's packages slurmctld, slurmd,
# slurm-client and munge (`apt-get install slurmctld slurmd slurm-client munge`).
# tests/slurm_cluster.py drives this script from Python (tests/test_slurm.py).

set -Eeuo pipefail

PREFIX="${DTRAIN_SLURM_PREFIX:-dtslurm}"
SUBNET="${DTRAIN_SLURM_SUBNET:-10.78.0}"
STATE="${DTRAIN_SLURM_DIR:-/tmp/dtrain-slurm-${PREFIX}}"
CPUS="${DTRAIN_SLURM_CPUS:-$(nproc)}"
NODES=2
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONF="${STATE}/slurm.conf"

die() {
    echo "slurm.sh: error: $*" >&2
    exit 2
}

usage() {
    echo "usage: $0 up | down | status | exec CMD ..." >&2
    exit 2
}

hosts() {
    DTRAIN_HOSTS_PREFIX="$PREFIX" DTRAIN_HOSTS_SUBNET="$SUBNET" bash "${HERE}/hosts.sh" "$@"
}

check_tools() {
    [[ "$(id -u)" == 0 ]] || die "needs root (network namespaces, and the Slurm daemons)"
    local tool missing=()
    for tool in munged slurmctld slurmd sinfo sbatch; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    ((${#missing[@]} == 0)) ||
        die "missing ${missing[*]}: apt-get install slurmctld slurmd slurm-client munge"
}

# The pid in a pid file, if that process is alive.
running_pid() {
    local pid
    [[ -f "$1" ]] || return 1
    pid="$(cat "$1" 2>/dev/null || true)"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

stop_daemon() {
    local pidfile="$1" pid tries=0
    pid="$(running_pid "$pidfile")" || return 0
    kill "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do
        tries=$((tries + 1))
        if ((tries > 50)); then
            kill -9 "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.1
    done
}

# Every process still running inside one of our namespaces (a job step slurmd left behind).
kill_namespace_processes() {
    local ns pid
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-h[0-9]+$" || true); do
        for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
            kill -9 "$pid" 2>/dev/null || true
        done
    done
}

down() {
    local i
    for ((i = 0; i < NODES; i++)); do
        stop_daemon "${STATE}/slurmd-n${i}.pid"
    done
    stop_daemon "${STATE}/slurmctld.pid"
    kill_namespace_processes
    stop_daemon "${STATE}/munge/munged.pid"
    hosts down >/dev/null
    if [[ -d "$STATE" ]]; then
        rm -rf "$STATE"
    fi
}

write_config() {
    local i
    mkdir -p "${STATE}/ctld" "${STATE}/cgroup" "${STATE}/munge"
    for ((i = 0; i < NODES; i++)); do
        mkdir -p "${STATE}/spool/n${i}"
    done
    # munged wants its socket's folder open to all (execute), its key readable by it alone.
    chmod 755 "$STATE" "${STATE}/munge"
    cat >"$CONF" <<EOF
# Written by scripts/slurm.sh: a two-node cluster in network namespaces on one machine.
ClusterName=dtrain
SlurmctldHost=$(hostname -s)(${SUBNET}.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${STATE}/munge/munge.socket
StateSaveLocation=${STATE}/ctld
SlurmdSpoolDir=${STATE}/spool/%n
SlurmctldPidFile=${STATE}/slurmctld.pid
SlurmdPidFile=${STATE}/slurmd-%n.pid
SlurmctldLogFile=${STATE}/slurmctld.log
SlurmdLogFile=${STATE}/slurmd-%n.log
# No systemd, no cgroups: processes are tracked by parentage, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
EOF
    for ((i = 0; i < NODES; i++)); do
        echo "NodeName=n${i} NodeAddr=${SUBNET}.$((i + 1)) CPUs=${CPUS} State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=main Nodes=n[0-$((NODES - 1))] Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
    # slurmd 22.05 initializes a cgroup plugin even with no cgroup plugin in use, and its
    # autodetection fails where /sys/fs/cgroup is no cgroup filesystem (as in a network
    # namespace's fresh /sys): the v1 plugin, pointed at an empty folder it never mounts.
    cat >"${STATE}/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupMountpoint=${STATE}/cgroup
CgroupAutomount=no
EOF
}

start_munge() {
    dd if=/dev/urandom of="${STATE}/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "${STATE}/munge/munge.key"
    munged --key-file="${STATE}/munge/munge.key" --socket="${STATE}/munge/munge.socket" \
        --pid-file="${STATE}/munge/munged.pid" --log-file="${STATE}/munge/munged.log" \
        --seed-file="${STATE}/munge/munged.seed" --force
}

show_logs() {
    local log
    for log in "${STATE}"/*.log "${STATE}"/munge/*.log; do
        [[ -f "$log" ]] && { echo "== ${log}" && tail -n 15 "$log"; } >&2
    done
    return 0
}

wait_idle() {
    local tries=0 idle
    while true; do
        idle="$(ip netns exec "${PREFIX}-h0" env SLURM_CONF="$CONF" sinfo -h -N -o '%N %t' 2>/dev/null |
            grep -c ' idle$' || true)"
        ((idle == NODES)) && return 0
        tries=$((tries + 1))
        if ((tries > 150)); then
            echo "slurm.sh: the nodes did not come up within 30 s" >&2
            return 1
        fi
        sleep 0.2
    done
}

up() {
    local i
    if [[ -e "$STATE" ]] || [[ -n "$(ip netns list 2>/dev/null | grep -E "^${PREFIX}-h" || true)" ]]; then
        die "a cluster named ${PREFIX} exists already: run '$0 down' first (or set DTRAIN_SLURM_PREFIX)"
    fi
    trap 'echo "slurm.sh: error: a step failed; the daemons logs say:" >&2; show_logs; down' ERR
    hosts up "$NODES" none >/dev/null
    write_config
    start_munge
    # SLURM_CONF too: the daemons find cgroup.conf beside it.
    ip netns exec "${PREFIX}-h0" env SLURM_CONF="$CONF" slurmctld -f "$CONF" -i
    for ((i = 0; i < NODES; i++)); do
        ip netns exec "${PREFIX}-h${i}" env SLURM_CONF="$CONF" slurmd -f "$CONF" -N "n${i}"
    done
    wait_idle
    trap - ERR
    echo "slurm.sh: two nodes up (n0 ${SUBNET}.1 with slurmctld, n1 ${SUBNET}.2), ${CPUS} CPUs each"
    echo "run Slurm commands on host 0: $0 exec sbatch job.sh   (SLURM_CONF=${CONF})"
}

status() {
    local name pidfile pid
    for name in munge/munged slurmctld slurmd-n0 slurmd-n1; do
        pidfile="${STATE}/${name}.pid"
        if pid="$(running_pid "$pidfile")"; then
            echo "${name##*/}: running (pid ${pid})"
        else
            echo "${name##*/}: not running"
        fi
    done
    if [[ -f "$CONF" ]]; then
        ip netns exec "${PREFIX}-h0" env SLURM_CONF="$CONF" sinfo -N 2>&1 || true
    fi
}

main() {
    (($# >= 1)) || usage
    local command="$1"
    shift
    [[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,9}$ ]] ||
        die "DTRAIN_SLURM_PREFIX='$PREFIX': letters and digits, starting with a letter, at most 10"
    case "$command" in
        up)
            (($# == 0)) || usage
            check_tools
            up
            ;;
        down)
            (($# == 0)) || usage
            [[ "$(id -u)" == 0 ]] || die "needs root"
            down
            ;;
        status)
            check_tools
            status
            ;;
        exec)
            (($# >= 1)) || usage
            exec ip netns exec "${PREFIX}-h0" env SLURM_CONF="$CONF" "$@"
            ;;
        *) usage ;;
    esac
}

main "$@"
