#!/usr/bin/env bash
# A throwaway SLURM cluster on this one machine, for CI and for trying scripts/slurm/train.sbatch (Debian, as root):
# Debian's slurmctld + one slurmd per fake node n1..nN, each slurmd in a private mount namespace whose /etc/hosts
# maps n1..nN to 127.0.0.1, so job steps resolve the node names (the system /etc/hosts is untouched).
#
#   scripts/slurm_cluster.sh up        install slurmctld slurmd slurm-client munge if missing, start, wait for idle
#   scripts/slurm_cluster.sh status    daemons, nodes and jobs
#   scripts/slurm_cluster.sh down      cancel jobs, then stop the daemons this script started, by PID
#
# Then: export SLURM_CONF=$DISTRIB_SLURM_ROOT/etc/slurm.conf (printed by up), and sbatch/srun/squeue as usual.
# Settings: DISTRIB_SLURM_ROOT (default /tmp/distrib-slurm), DISTRIB_SLURM_NODES (2), DISTRIB_SLURM_CPUS (nproc).
set -euo pipefail
ROOT=${DISTRIB_SLURM_ROOT:-/tmp/distrib-slurm}
NODES=${DISTRIB_SLURM_NODES:-2}
CPUS=${DISTRIB_SLURM_CPUS:-$(nproc)}
PACKAGES=(slurmctld slurmd slurm-client munge)
export SLURM_CONF=$ROOT/etc/slurm.conf

say() { echo "slurm_cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return 0
  fi
  [ "$(id -u)" -eq 0 ] || die "SLURM is not installed and installing it needs root: apt-get install ${PACKAGES[*]}"
  command -v apt-get >/dev/null || die "SLURM is not installed and apt-get is missing; install ${PACKAGES[*]}"
  say "installing ${PACKAGES[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed; is a Debian package mirror reachable?"
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null \
    || die "apt-get install ${PACKAGES[*]} failed"
}

free_ports() {  # free_ports N: N distinct free TCP ports, chosen by the kernel (no fixed port can clash)
  python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

write_config() {
  local ports i nodes=""
  read -r -a ports <<< "$(free_ports $((NODES + 1)))"
  for i in $(seq "$NODES"); do
    nodes+="NodeName=n$i NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=${ports[$i]} CPUs=$CPUS State=UNKNOWN"$'\n'
  done
  # A random first job id: the rendezvous port distrib launch derives from the job id differs between clusters.
  cat > "$SLURM_CONF" <<EOF
ClusterName=distrib-ci
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
FirstJobId=$((1000 + RANDOM * 10))
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
# No cgroups or CPU binding: the fake nodes share this machine's CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MpiDefault=none
MailProg=/bin/true
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
$nodes
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  [ -s /etc/munge/munge.key ] || runuser -u munge -- /usr/sbin/mungekey --create
  install -d -o munge -g munge -m 0755 /run/munge
  if ! { [ -s /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; }; then
    runuser -u munge -- /usr/sbin/munged
    cp /run/munge/munged.pid "$ROOT/run/munged.pid"  # only a munged this script started is stopped by down
  fi
  munge -n | unmunge >/dev/null || die "munge does not work; see /var/log/munge/munged.log"
}

wait_idle() {
  local i idle=0
  for i in $(seq 300); do  # up to 60 s
    idle=$(sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle$' || true)
    [ "$idle" -eq "$NODES" ] && return 0
    sleep 0.2
  done
  tail -n 20 "$ROOT"/log/*.log >&2 || true
  die "$idle of $NODES nodes idle after 60 s; logs in $ROOT/log"
}

up() {
  local i started
  [ "$NODES" -ge 1 ] || die "DISTRIB_SLURM_NODES=$NODES: need at least 1"
  if [ -s "$ROOT/run/slurmctld.pid" ] && kill -0 "$(cat "$ROOT/run/slurmctld.pid")" 2>/dev/null; then
    die "a cluster already runs in $ROOT; run: $0 down"
  fi
  install_packages
  started=$(date +%s.%N)
  rm -rf "$ROOT/state" "$ROOT/spool"  # a fresh cluster: no jobs or node states from an earlier one
  mkdir -p "$ROOT"/{etc,state,spool,run,log}
  write_config
  start_munge
  /usr/sbin/slurmctld  # daemonizes; writes its PID file
  { cat /etc/hosts; echo "127.0.0.1 $(seq -f 'n%g' -s ' ' "$NODES")"; } > "$ROOT/etc/hosts"
  for i in $(seq "$NODES"); do
    mkdir -p "$ROOT/spool/n$i"
    # The bind mount lives only in this slurmd's mount namespace, which its job steps inherit.
    unshare --mount --propagation private \
      sh -c "mount --bind '$ROOT/etc/hosts' /etc/hosts && exec /usr/sbin/slurmd -N n$i"
  done
  wait_idle
  sinfo -N >&2
  say "up in $(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}') s; now run:"
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop_pidfile() {  # stop_pidfile FILE COMM: SIGTERM, up to 20 s, then SIGKILL; only if the PID still runs COMM
  local file=$1 pid i
  [ -s "$file" ] || return 0
  pid=$(cat "$file")
  if kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then
    kill -TERM "$pid"
    for i in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { kill -KILL "$pid"; say "$2 ($pid) killed"; } || say "$2 ($pid) stopped"
  fi
  rm -f "$file"
}

down() {
  local file i
  if [ -s "$ROOT/run/slurmctld.pid" ] && kill -0 "$(cat "$ROOT/run/slurmctld.pid")" 2>/dev/null; then
    # Jobs first: a job step's processes outlive slurmd, so stopping the daemons alone would leave them running.
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    for i in $(seq 150); do  # up to 30 s
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  for file in "$ROOT"/run/slurmd-*.pid; do [ -e "$file" ] && stop_pidfile "$file" slurmd; done
  stop_pidfile "$ROOT/run/slurmctld.pid" slurmctld
  stop_pidfile "$ROOT/run/munged.pid" munged
  return 0
}

status() {
  local file
  for file in "$ROOT"/run/*.pid; do
    [ -e "$file" ] || { echo "no daemons started from $ROOT"; return 1; }
    if kill -0 "$(cat "$file")" 2>/dev/null; then echo "$(basename "$file" .pid): running"; else
      echo "$(basename "$file" .pid): dead"; fi
  done
  sinfo -N && squeue
}

case "${1:-}" in
  up | down | status) "$1" ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
