#!/usr/bin/env bash
# Start a real two-node SLURM cluster on this one machine (node1, node2 on 127.0.0.1).
#
# Uses Debian's slurmctld/slurmd/slurm-client/munge, installing them when missing.
# Idempotent: a cluster that already answers `sinfo` with both nodes idle is left alone.
# Stop it with ci/slurm_down.sh.
set -euo pipefail

state=${NEMO_SAFE_SLURM_STATE:-/var/lib/nemo_safe_slurm}
host=$(hostname -s)

need_pkgs=()
for bin in slurmctld:slurmctld slurmd:slurmd srun:slurm-client munged:munge; do
    command -v "${bin%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${bin%%:*}" ] || need_pkgs+=("${bin##*:}")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "slurm_up: missing ${need_pkgs[*]}; run as root or install them with apt-get" >&2
        exit 1
    fi
    echo "slurm_up: installing ${need_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

if sinfo -h -o '%N %t' 2>/dev/null | grep -Eq 'node\[1-2\] idle|node\[1-2\] mix'; then
    echo "slurm_up: cluster already up"
    exit 0
fi

# munge: the daemon runs as user munge and wants its directories owned by it.
mkdir -p /run/munge /var/log/munge /etc/munge /var/lib/munge
chown -R munge:munge /run/munge /var/log/munge /etc/munge /var/lib/munge
chmod 0755 /run/munge
[ -s /etc/munge/munge.key ] || runuser -u munge -- /usr/sbin/mungekey --create
if ! munge -n >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null

mkdir -p /etc/slurm "$state"
cat > /etc/slurm/slurm.conf <<CONF
# Written by nemo_safe ci/slurm_up.sh: a two-node test cluster on one machine.
ClusterName=nemosafe
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
SlurmctldPort=6817
StateSaveLocation=${state}/ctld
SlurmctldPidFile=${state}/slurmctld.pid
SlurmctldLogFile=${state}/slurmctld.log
SlurmdSpoolDir=${state}/d-%n
SlurmdPidFile=${state}/slurmd-%n.pid
SlurmdLogFile=${state}/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
InactiveLimit=0
KillWait=5
MinJobAge=30
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=node1 NodeHostname=${host} NodeAddr=127.0.0.1 Port=17001 CPUs=8 RealMemory=4000 State=UNKNOWN
NodeName=node2 NodeHostname=${host} NodeAddr=127.0.0.1 Port=17002 CPUs=8 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
mkdir -p "$state/ctld"

pgrep -x slurmctld >/dev/null || slurmctld
for n in node1 node2; do
    pgrep -f "slurmd -N $n" >/dev/null || slurmd -N "$n"
done

for _ in $(seq 100); do
    sinfo -h >/dev/null 2>&1 && break
    sleep 0.2
done
scontrol update nodename=node[1-2] state=resume 2>/dev/null || true
for _ in $(seq 100); do
    if sinfo -h -o '%N %t' 2>/dev/null | grep -Eq 'node\[1-2\] idle'; then
        echo "slurm_up: cluster up (node1, node2)"
        exit 0
    fi
    sleep 0.3
done
echo "slurm_up: nodes did not become idle; see $state/*.log" >&2
sinfo -N -l >&2 || true
exit 1
