#!/usr/bin/env bash
# A real single-node Slurm on this machine, for development and tests (no systemd needed).
#
#   slurm/dev-cluster.sh up      install the Debian packages if missing, start munge, MariaDB,
#                                slurmdbd (so sacct works), slurmctld and slurmd; wait until idle
#   slurm/dev-cluster.sh down    stop them by PID
#   slurm/dev-cluster.sh status  what runs, and sinfo
#
# Everything lives under $ORCHARD_SLURM_DIR (default /tmp/orchard-slurm). Facts behind the
# settings: shared/notes/slurm-single-node.md. Needs root.
set -euo pipefail

DIR=${ORCHARD_SLURM_DIR:-/tmp/orchard-slurm}
ETC=/etc/slurm
PACKAGES="slurm-wlm slurmctld slurmd munge slurmdbd mariadb-server"
DB_SOCKET=/run/mysqld/mysqld.sock  # the client library's default: slurmdbd reaches it with StorageHost=localhost

db_password() {  # made once per cluster directory, readable by root alone (it was a constant in this script)
  local file="$DIR/db-password"
  if [ ! -s "$file" ]; then
    (umask 077; head -c 32 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' > "$file")
  fi
  cat "$file"
}
DAEMONS="munged mariadbd slurmdbd slurmctld slurmd"

log() { echo "dev-cluster: $*" >&2; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2; shift 2
  for _ in $(seq $((limit * 10))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  log "timed out waiting for $what"; return 1
}

install() {
  local missing=""
  for p in $PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    log "installing:$missing"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  fi
}

write_configs() {
  local cpus mem DB_PASSWORD
  mkdir -p "$DIR"
  DB_PASSWORD=$(db_password)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
  mkdir -p "$DIR"/{state,spool,log,run,mysql} "$ETC"
  cat > "$ETC/slurm.conf" <<EOF
ClusterName=orchard-dev
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
KillWait=5
MinJobAge=300
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  # Jobs run in cgroups of their own (proctrack/cgroup, task/cgroup), as on real clusters:
  # whatever a job leaves behind in its cgroup is killed when the job ends.
  cat > "$ETC/cgroup.conf" <<EOF
CgroupPlugin=autodetect
ConstrainCores=no
ConstrainRAMSpace=yes
ConstrainDevices=no
EOF
  cat > "$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASSWORD
StorageLoc=slurm_acct_db
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
EOF
  chmod 600 "$ETC/slurmdbd.conf"
}

start_munge() {
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  if ! munge -n >/dev/null 2>&1; then
    setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F >"$DIR/log/munged.log" 2>&1 &
    echo $! > "$DIR/run/munged.pid"
    wait_for 10 munge munge -n
  fi
}

start_mariadb() {
  if [ ! -d "$DIR/mysql/mysql" ]; then
    mariadb-install-db --datadir="$DIR/mysql" --user=mysql >"$DIR/log/mariadb-install.log" 2>&1
  fi
  chown -R mysql:mysql "$DIR/mysql"
  mkdir -p "$(dirname "$DB_SOCKET")"
  chown mysql:mysql "$(dirname "$DB_SOCKET")"
  # No TCP listener at all (a sandbox that reached the node's loopback logged in with the
  # published password): the Unix socket only, and no anonymous accounts.
  mariadbd --no-defaults --user=mysql --datadir="$DIR/mysql" --socket="$DB_SOCKET" --skip-networking \
    --pid-file="$DIR/mysql/mariadb.pid" >"$DIR/log/mariadb.log" 2>&1 &
  wait_for 30 mariadb mariadb --socket="$DB_SOCKET" -e "select 1"
  mariadb --socket="$DB_SOCKET" <<EOF
DROP USER IF EXISTS 'slurm'@'127.0.0.1';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$(db_password)';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$(db_password)';
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
DELETE FROM mysql.global_priv WHERE User = '';
FLUSH PRIVILEGES;
EOF
}

up() {
  [ "$(id -u)" = 0 ] || { log "needs root"; exit 1; }
  install
  write_configs
  start_munge
  start_mariadb
  slurmdbd -D >"$DIR/log/slurmdbd.out" 2>&1 &
  wait_for 30 slurmdbd bash -c "echo > /dev/tcp/127.0.0.1/6819"
  slurmctld -D -i >"$DIR/log/slurmctld.out" 2>&1 &
  wait_for 30 slurmctld bash -c "scontrol ping | grep -q UP"
  sacctmgr -i add cluster orchard-dev >/dev/null 2>&1 || true
  slurmd -D -N localhost >"$DIR/log/slurmd.out" 2>&1 &
  wait_for 30 "an idle node" bash -c "sinfo -h -o %T | grep -qE 'idle|mixed|allocated'"
  log "up: $(sinfo -h -o '%P %D %T')"
}

stop_pidfile() {
  local file=$1
  if [ -s "$file" ]; then
    kill "$(cat "$file")" 2>/dev/null || true
    rm -f "$file"
  fi
}

down() {
  for daemon in slurmd slurmctld slurmdbd; do pkill -x "$daemon" 2>/dev/null || true; done
  stop_pidfile "$DIR/mysql/mariadb.pid"
  stop_pidfile "$DIR/run/munged.pid"
  for _ in $(seq 50); do running >/dev/null || break; sleep 0.1; done
  log "down"
}

running() {  # prints the daemons that run; fails if none does
  local found=1
  for daemon in $DAEMONS; do pgrep -ax "$daemon" && found=0; done
  return $found
}

status() {
  running || true
  sinfo 2>/dev/null || log "slurmctld not reachable"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
