#!/usr/bin/env bash
# Start a throw-away SLURM cluster on this host for the tests: munged, slurmctld and two slurmd "nodes"
# n1 and n2 (both NodeAddr=127.0.0.1, own ports), all state, sockets and logs under DIR.
# Usage: bash tests/slurm/up.sh DIR   then   export SLURM_CONF=DIR/slurm.conf ; stop with tests/slurm/down.sh DIR
# Runs as root (SlurmUser=root). Nothing is installed here: CI installs slurm-wlm and munge.
set -euo pipefail
D=${1:?usage: up.sh DIR}
NODES=${NODES:-2}
mkdir -p "$D"/{state,log,munge}
chmod 755 "$D"
D=$(cd "$D" && pwd)

# Ports picked by the kernel, so two clusters (or a stale one) on one host never collide.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
CTLD_PORT=$(free_port)
HOST=$(hostname -s)
CPUS=$(nproc)

cat > "$D/slurm.conf" <<CONF
ClusterName=mlengtest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool-%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$D/log/jobcomp.txt
CONF
for i in $(seq 1 "$NODES"); do
  echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$CPUS RealMemory=2000 State=UNKNOWN" >> "$D/slurm.conf"
done
echo "PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP" >> "$D/slurm.conf"
export SLURM_CONF=$D/slurm.conf

# Our own munged on our own socket with our own key: a system munged (or another test's) is left alone,
# and nothing depends on the package having generated /etc/munge/munge.key.
dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$D/munge/munge.key"
chown -R munge:munge "$D/munge"
runuser -u munge -- /usr/sbin/munged --force --socket="$D/munge/munge.socket" --key-file="$D/munge/munge.key" \
  --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"
munge --socket="$D/munge/munge.socket" -n | unmunge --socket="$D/munge/munge.socket" >/dev/null

slurmctld
for i in $(seq 1 "$NODES"); do slurmd -N "n$i"; done
for i in $(seq 300); do
  [ "$(sinfo -h -N -o %T 2>/dev/null | grep -c idle)" = "$NODES" ] && break
  sleep 0.1
done
if [ "$(sinfo -h -N -o %T 2>/dev/null | grep -c idle)" != "$NODES" ]; then
  echo "up.sh: the $NODES nodes did not become idle within 30 s:" >&2
  sinfo -N >&2 || true
  tail -5 "$D"/log/*.log >&2 || true
  exit 1
fi
echo "export SLURM_CONF=$D/slurm.conf"
