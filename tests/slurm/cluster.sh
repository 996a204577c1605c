#!/usr/bin/env bash
# cluster.sh -- moe-launch's local Slurm test cluster: N virtual nodes on this one machine.
#
# Debian 12's slurm-wlm 22.05 slurmd is built for "multiple slurmd" mode, so we run one
# slurmctld plus one `slurmd -N nodeK` per virtual node, each on its own port. Every slurmd
# lives in its own UTS namespace whose hostname is nodeK.hpc.example, not the NodeName nodeK:
# many real clusters look like that, and code that names a node by its hostname must fail here.
# Both names resolve via a managed /etc/hosts block to 127.0.100.K. munged, mariadbd and slurmdbd (for sacct, which
# submitit polls) are private instances under the state dir. No systemd, no cgroups. Root only.
#
# Commands:
#   up [N]             install packages if missing; start N nodes (default 6); wait until N idle.
#                      A healthy cluster that already has N nodes is left alone (idempotent);
#                      anything else is stopped first, and a fresh start wipes all state.
#   restart [N]        down + up: always a fresh, wiped cluster (other users' jobs are killed!)
#   down               cancel jobs, stop everything started here (by PID file), undo /etc changes
#   status             daemons (UP/DEAD) and `sinfo -N`; exit 0 only if slurmctld answers
#   env                print `export SLURM_CONF=...`
#   kill-node NODE     hard failure: SIGKILL NODE's slurmd, its slurmstepds and their task trees
#   start-node NODE    (re)start NODE's slurmd; a node DOWN for "Not responding" returns to idle
#   stop-slurmd NODE   SIGKILL only NODE's slurmd, leaving its steps/tasks running
#                      (the node goes NOT_RESPONDING, then DOWN after SlurmdTimeout)
#   resume-node NODE   scontrol update nodename=NODE state=resume (undo an admin DOWN/DRAIN)
#   stop-controller    stop slurmctld (state saved; jobs and steps keep running): a controller outage
#   start-controller   start slurmctld again from its saved state
#
# Knobs (environment):
#   MOE_SLURM_DIR=/tmp/moe-launch-slurm   state dir (wiped on a fresh `up`)
#   MOE_SLURM_PORT_BASE=17800             slurmctld +17, slurmd default +18, slurmdbd +19,
#                                         mariadb +6, nodeK +100+K
#   MOE_SLURM_CPUS=2                      CPUs per node (may exceed the real cores)
#   MOE_SLURM_MEM=4096                    RealMemory per node in MB
#   MOE_SLURM_GPUS=0                      fake gres gpu:N per node (scheduling only)
#   MOE_SLURM_ACCOUNTING=1                0: no mariadb/slurmdbd (sacct then fails)
#   MOE_SLURM_SLURMD_TIMEOUT=10           seconds before a silent node is marked DOWN
#   MOE_SLURM_EXTRA_CONF=""               extra slurm.conf lines, e.g. "JobRequeue=0"
set -euo pipefail

STATE=${MOE_SLURM_DIR:-/tmp/moe-launch-slurm}
PORT_BASE=${MOE_SLURM_PORT_BASE:-17800}
NODE_CPUS=${MOE_SLURM_CPUS:-2}
NODE_MEM=${MOE_SLURM_MEM:-4096}
NODE_GPUS=${MOE_SLURM_GPUS:-0}
ACCOUNTING=${MOE_SLURM_ACCOUNTING:-1}
SLURMD_TIMEOUT=${MOE_SLURM_SLURMD_TIMEOUT:-10}
EXTRA_CONF=${MOE_SLURM_EXTRA_CONF:-}

for knob in PORT_BASE NODE_CPUS NODE_MEM NODE_GPUS ACCOUNTING SLURMD_TIMEOUT; do
  [[ "${!knob}" =~ ^[0-9]+$ ]] || { echo "cluster.sh: MOE_SLURM_${knob#NODE_} must be a number, got '${!knob}'" >&2; exit 2; }
done
CTLD_PORT=$((PORT_BASE + 17))
SLURMD_DEFAULT_PORT=$((PORT_BASE + 18))
DBD_PORT=$((PORT_BASE + 19))
DB_PORT=$((PORT_BASE + 6))
NODE_PORT_BASE=$((PORT_BASE + 100))

# slurmd must get an absolute -f path: it chdirs to / when it daemonizes and
# a relative path then breaks reconfigure (it spins and ignores SIGTERM).
CONF=$STATE/etc/slurm.conf
PIDS=$STATE/run
LOGS=$STATE/log
MUNGE_SOCKET=$STATE/munge/socket
DB_SOCKET=$STATE/db/mysqld.sock
SYSTEM_CONF=/etc/slurm/slurm.conf
# The state dir is wiped on `up`, which would restart job ids at 1 and let a test
# read a stale per-job folder (submitit "%j"); the next id is kept outside it.
NEXT_JOBID_FILE=$STATE.next-jobid
HOSTS_BEGIN="# >>> moe-launch slurm test cluster ($STATE) >>>"
HOSTS_END="# <<< moe-launch slurm test cluster ($STATE) <<<"
APT_LOG=/tmp/moe-launch-slurm-apt.log
export SLURM_CONF=$CONF

log() { echo "[cluster.sh $(date +%H:%M:%S)] $*" >&2; }
fail() { log "ERROR: $*"; exit 1; }

# ------------------------------------------------------------------ processes
# A pid is "ours" only if the process is alive and its command line or
# environment names our state dir. A zombie has an empty cmdline and counts as
# dead (PID 1 here reaps lazily, so `kill -0` would lie); the path check also
# guards against pid reuse. slurmdbd has no path argument: its SLURM_CONF counts.
is_ours() {
  local pid=$1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  if { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | grep -qF -- "$STATE/"; then return 0; fi
  { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qxF -- "SLURM_CONF=$CONF"
}
read_pid() { cat "$1" 2>/dev/null || true; }

# stop_daemon PIDFILE LABEL SECONDS: SIGTERM, wait, SIGKILL if it lingers.
stop_daemon() {
  local pidfile=$1 label=$2 grace=$3 pid i
  pid=$(read_pid "$pidfile")
  if is_ours "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < grace * 10; i++)); do is_ours "$pid" || break; sleep 0.1; done
    if is_ours "$pid"; then log "$label ($pid) survived SIGTERM; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
    log "stopped $label (pid $pid)"
  fi
  rm -f "$pidfile"
}

# pid plus all its descendants, via /proc/PID/task/*/children
process_tree() {
  local pid=$1 child
  echo "$pid"
  for child in $(cat /proc/"$pid"/task/*/children 2>/dev/null); do process_tree "$child"; done
}

# slurmstepd processes of this cluster (optionally of one node). They are found by
# their executable (Debian installs it as slurmstepd-wlm) and by the node's slurmd
# log file, which every slurmstepd keeps open.
find_stepds() {
  local node=${1:-} want proc pid
  if [ -n "$node" ]; then want="$LOGS/slurmd-$node.log"; else want="$LOGS/slurmd-"; fi
  for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    case "$(readlink "$proc/exe" 2>/dev/null)" in */slurmstepd*) ;; *) continue ;; esac
    if ls -l "$proc/fd" 2>/dev/null | grep -qF -- "$want"; then echo "$pid"; fi
  done
}

sigkill_trees() {
  local victims="" pid
  for pid in "$@"; do victims="$victims $(process_tree "$pid")"; done
  if [ -n "${victims// /}" ]; then kill -KILL $victims 2>/dev/null || true; fi
}

# wait_until SECONDS WHAT CMD...: poll CMD every 0.1 s.
wait_until() {
  local seconds=$1 what=$2 i
  shift 2
  for ((i = 0; i < seconds * 10; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  fail "timed out after ${seconds}s waiting for $what (logs in $LOGS)"
}

# ------------------------------------------------------------------ packages
ensure_packages() {
  local wanted=(slurmctld slurmd slurm-client munge) missing=() pkg made_policy=0 rc=0
  [ "$ACCOUNTING" = 1 ] && wanted+=(slurmdbd mariadb-server)
  for pkg in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
  done
  [ ${#missing[@]} = 0 ] && return 0
  log "installing ${missing[*]} (log: $APT_LOG)"
  # policy-rc.d exit 101 keeps the packages' init scripts from starting system daemons
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    made_policy=1
  fi
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}")
  if ! "${apt[@]}" >"$APT_LOG" 2>&1; then
    log "install failed; apt-get update once and retry"
    apt-get update -q >>"$APT_LOG" 2>&1 || true
    "${apt[@]}" >>"$APT_LOG" 2>&1 || rc=$?
  fi
  [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ $rc = 0 ] || fail "apt-get install failed; see $APT_LOG"
}

# ------------------------------------------------------------------ config files
node_name() { echo "node$1"; }
# the node's hostname (what `hostname` prints in its tasks) deliberately differs from its NodeName
HOST_DOMAIN=hpc.example
node_host() { echo "$1.$HOST_DOMAIN"; }

write_slurm_conf() {
  local n=$1 k first_jobid gres_types="" node_gres="" accounting
  first_jobid=$(cat "$NEXT_JOBID_FILE" 2>/dev/null || true)
  [[ "$first_jobid" =~ ^[0-9]+$ ]] && [ "$first_jobid" -lt 60000000 ] || first_jobid=1
  if [ "$NODE_GPUS" -gt 0 ]; then gres_types="GresTypes=gpu"; node_gres=" Gres=gpu:$NODE_GPUS"; fi
  if [ "$ACCOUNTING" = 1 ]; then
    # AccountingStoragePass names the munge socket for ctld<->slurmdbd traffic;
    # without it they use the system socket and fail with "Protocol authentication error".
    accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET"
  else
    accounting="AccountingStorageType=accounting_storage/none"
  fi
  cat >"$CONF" <<EOF
# Written by tests/slurm/cluster.sh: $n virtual nodes on one machine (multiple-slurmd mode).
ClusterName=moetest
FirstJobId=$first_jobid
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_DEFAULT_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$PIDS/slurmctld.pid
SlurmdPidFile=$PIDS/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups in this VM
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# the default delay (3 s) would slow every sbatch start
SchedulerParameters=batch_sched_delay=0
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
$accounting
$gres_types
# 1: a node DOWN for not responding comes back when its slurmd registers again,
# but an admin DOWN/DRAIN stays until state=resume (2 would silently undo it).
ReturnToService=1
SlurmdTimeout=$SLURMD_TIMEOUT
SlurmctldTimeout=10
MessageTimeout=10
InactiveLimit=0
KillWait=5
Waittime=0
MinJobAge=300
JobRequeue=1
# each virtual node claims CPUs/memory the machine does not really have
SlurmdParameters=config_overrides
EOF
  for ((k = 1; k <= n; k++)); do
    echo "NodeName=$(node_name $k) NodeHostname=$(node_name $k) NodeAddr=127.0.100.$k Port=$((NODE_PORT_BASE + k))" \
      "CPUs=$NODE_CPUS Sockets=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=$NODE_MEM$node_gres State=UNKNOWN" >>"$CONF"
  done
  echo "PartitionName=debug Nodes=node[1-$n] Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
  if [ -n "$EXTRA_CONF" ]; then printf '%s\n' "$EXTRA_CONF" >>"$CONF"; fi

  if [ "$NODE_GPUS" -gt 0 ]; then
    # gres/gpu ignores GPUs without File= and wants character devices: fake ones
    # with nvidia's major number, never opened by anything.
    mkdir -p "$STATE/dev"
    for ((k = 0; k < NODE_GPUS; k++)); do mknod "$STATE/dev/nvidia$k" c 195 "$k"; done
    echo "NodeName=node[1-$n] Name=gpu File=$STATE/dev/nvidia[0-$((NODE_GPUS - 1))]" >"$STATE/etc/gres.conf"
  fi

  if [ "$ACCOUNTING" = 1 ]; then
    # slurmdbd has no -f: it reads slurmdbd.conf beside $SLURM_CONF and refuses it unless mode 600
    cat >"$STATE/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$LOGS/slurmdbd.log
PidFile=$PIDS/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$STATE/etc/slurmdbd.conf"
  fi
}

# /etc/hosts is rewritten in place (it may be a bind mount, so keep the inode)
hosts_block_remove() {
  grep -qF "$HOSTS_BEGIN" /etc/hosts 2>/dev/null || return 0
  local kept
  kept=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1; next} $0 == e {skip = 0; next} !skip' /etc/hosts)
  printf '%s\n' "$kept" >/etc/hosts
}
hosts_block_add() {
  local n=$1 k
  hosts_block_remove
  {
    echo "$HOSTS_BEGIN"
    for ((k = 1; k <= n; k++)); do echo "127.0.100.$k $(node_host "$(node_name $k)") $(node_name $k)"; done
    echo "$HOSTS_END"
  } >>/etc/hosts
}

# /etc/slurm/slurm.conf -> our conf, so plain sbatch/srun/submitit need no SLURM_CONF.
# A foreign file or link there is left alone (then clients need `cluster.sh env`).
link_system_conf() {
  mkdir -p /etc/slurm
  if [ -L "$SYSTEM_CONF" ] && [ "$(readlink "$SYSTEM_CONF")" = "$CONF" ]; then return 0; fi
  if [ -e "$SYSTEM_CONF" ] || [ -L "$SYSTEM_CONF" ]; then
    log "WARNING: $SYSTEM_CONF belongs to someone else; clients need: export SLURM_CONF=$CONF"
    return 0
  fi
  ln -s "$CONF" "$SYSTEM_CONF"
}
unlink_system_conf() {
  if [ -L "$SYSTEM_CONF" ] && [ "$(readlink "$SYSTEM_CONF")" = "$CONF" ]; then rm -f "$SYSTEM_CONF"; fi
}

# ------------------------------------------------------------------ daemons
start_munged() {
  # munged refuses a socket dir that is not world-executable
  chmod 755 "$STATE/munge"
  dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$STATE/munge/munge.key"
  munged --key-file="$STATE/munge/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$PIDS/munged.pid" \
    --log-file="$LOGS/munged.log" --seed-file="$STATE/munge/seed" --num-threads=10 \
    || fail "munged did not start; see $LOGS/munged.log"
  wait_until 10 munged test -S "$MUNGE_SOCKET"
}

db_ping() { mariadb-admin --no-defaults -S "$DB_SOCKET" -u root ping; }

start_accounting() {
  mkdir -p "$STATE/db"
  mariadb-install-db --no-defaults --user=root --datadir="$STATE/db/data" --skip-test-db \
    --auth-root-authentication-method=socket >"$LOGS/mariadb-install.log" 2>&1 \
    || fail "mariadb-install-db failed; see $LOGS/mariadb-install.log"
  setsid mariadbd --no-defaults --user=root --datadir="$STATE/db/data" --socket="$DB_SOCKET" \
    --pid-file="$PIDS/mariadbd.pid" --log-error="$LOGS/mariadbd.log" --bind-address=127.0.0.1 \
    --port="$DB_PORT" --skip-name-resolve --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 &
  wait_until 60 mariadbd db_ping
  mariadb --no-defaults -S "$DB_SOCKET" -u root -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  slurmdbd || fail "slurmdbd did not start; see $LOGS/slurmdbd.log"
  wait_until 60 slurmdbd grep -q 'slurmdbd version .* started' "$LOGS/slurmdbd.log"
}

ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

start_slurmd() {
  local node=$1
  mkdir -p "$STATE/spool/$node"
  rm -f "$PIDS/slurmd-$node.pid"
  # a private UTS namespace: `hostname` inside the node's tasks prints nodeK.hpc.example, Slurm calls it nodeK
  unshare --uts sh -c "hostname '$(node_host "$node")' && exec slurmd -f '$CONF' -N '$node'" \
    </dev/null >>"$LOGS/slurmd-$node.stdout" 2>&1 || fail "slurmd $node did not start; see $LOGS/slurmd-$node.log"
  wait_until 15 "slurmd $node pid file" test -s "$PIDS/slurmd-$node.pid"
}

idle_count() { sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l; }
node_count() { sinfo -h -N -o '%N' 2>/dev/null | sort -u | wc -l; }

# true if every daemon we have a PID file for is alive and the controller answers
cluster_healthy() {
  local f
  ctld_up || return 1
  for f in "$PIDS"/*.pid; do [ -e "$f" ] || return 1; is_ours "$(read_pid "$f")" || return 1; done
}

# ------------------------------------------------------------------ commands
# Descriptors inherited from the caller (say the lock of `flock LOCK cluster.sh up`) would live on in the
# daemons and hold that lock for as long as the cluster runs.
close_inherited_fds() {
  local fd
  for fd in $(ls /proc/$$/fd); do
    if [ "$fd" -gt 2 ] && [ "$fd" != 255 ]; then eval "exec $fd>&-"; fi
  done
}

cmd_up() {
  local n=${1:-6} t0=$SECONDS t_install i
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 99 ] || fail "node count must be 1..99, got '$n'"
  if [ -d "$PIDS" ] && cluster_healthy && [ "$(node_count)" = "$n" ]; then
    log "already up with $n nodes (use 'restart $n' for a fresh, wiped cluster)"
    sinfo
    return 0
  fi
  if compgen -G "$PIDS/*.pid" >/dev/null; then log "stopping the existing (unhealthy or differently sized) cluster"; cmd_down; fi
  ensure_packages
  t_install=$((SECONDS - t0))
  # a half-started cluster is torn down again so that the next `up` starts clean
  trap 'log "up failed; stopping what was started (logs kept in $LOGS)"; cmd_down || true' ERR EXIT
  rm -rf "$STATE"
  mkdir -p "$STATE"/{etc,run,log,state,spool,munge}
  chmod 755 "$STATE"
  start_munged
  write_slurm_conf "$n"
  hosts_block_add "$n"
  link_system_conf
  if [ "$ACCOUNTING" = 1 ]; then start_accounting; fi
  # -c: no old state, -i: ignore state-file errors; every `up` gets fresh idle nodes
  slurmctld -f "$CONF" -c -i || fail "slurmctld did not start; see $LOGS/slurmctld.log"
  wait_until 30 slurmctld ctld_up
  for ((i = 1; i <= n; i++)); do start_slurmd "$(node_name $i)"; done
  log "waiting for $n idle nodes"
  for ((i = 0; i < 600; i++)); do [ "$(idle_count)" -ge "$n" ] && break; sleep 0.1; done
  if [ "$(idle_count)" -lt "$n" ]; then sinfo -N >&2 || true; fail "only $(idle_count)/$n nodes idle after 60 s"; fi
  trap - ERR EXIT
  log "up: $n nodes idle (package install ${t_install}s, total $((SECONDS - t0))s)"
  sinfo
  if [ ! -L "$SYSTEM_CONF" ] || [ "$(readlink "$SYSTEM_CONF")" != "$CONF" ]; then echo "export SLURM_CONF=$CONF"; fi
}

cmd_down() {
  local f node next ids i stray
  trap - ERR EXIT
  if [ ! -d "$STATE" ]; then log "nothing to stop ($STATE absent)"; hosts_block_remove; unlink_system_conf; return 0; fi
  if is_ours "$(read_pid "$PIDS/slurmctld.pid")"; then
    next=$(scontrol show config 2>/dev/null | awk '$1 == "NEXT_JOB_ID" {print $3}' || true)
    if [[ "$next" =~ ^[0-9]+$ ]]; then echo "$next" >"$NEXT_JOBID_FILE"; fi
    # cancelled jobs let their slurmstepds clean up their tasks the normal way
    ids=$(squeue -h -o '%A' 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${ids// /}" ]; then
      log "cancelling jobs $ids"
      scancel $ids 2>/dev/null || true
      for ((i = 0; i < 150; i++)); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.1; done
    fi
  fi
  for f in "$PIDS"/slurmd-*.pid; do
    [ -e "$f" ] || continue
    node=${f##*/slurmd-}
    stop_daemon "$f" "slurmd ${node%.pid}" 10
  done
  stray=$(find_stepds | tr '\n' ' ')
  if [ -n "${stray// /}" ]; then log "killing leftover slurmstepd trees: $stray"; sigkill_trees $stray; fi
  stop_daemon "$PIDS/slurmctld.pid" slurmctld 15
  stop_daemon "$PIDS/slurmdbd.pid" slurmdbd 15
  stop_daemon "$PIDS/mariadbd.pid" mariadbd 30
  stop_daemon "$PIDS/munged.pid" munged 10
  hosts_block_remove
  unlink_system_conf
  log "down"
}

cmd_status() {
  local f pid state rc=0
  for f in "$PIDS"/*.pid; do
    [ -e "$f" ] || continue
    pid=$(read_pid "$f")
    if is_ours "$pid"; then state=UP; else state=DEAD; fi
    echo "$state $(basename "$f" .pid) pid=$pid"
  done
  ctld_up || { echo "slurmctld not answering"; rc=1; }
  sinfo -N -o '%N %T %E' 2>/dev/null || true
  return $rc
}

need_node() { [[ "${1:-}" =~ ^node[0-9]+$ ]] || fail "expected a node name like node3, got '${1:-}'"; }

cmd_kill_node() {
  local node=$1 pid steps
  need_node "$node"
  pid=$(read_pid "$PIDS/slurmd-$node.pid")
  steps=$(find_stepds "$node" | tr '\n' ' ')
  log "hard-failing $node: slurmd=${pid:-none} slurmstepds=[${steps% }] and their tasks"
  if is_ours "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  if [ -n "${steps// /}" ]; then sigkill_trees $steps; fi
  rm -f "$PIDS/slurmd-$node.pid"
}

cmd_stop_slurmd() {
  local node=$1 pid
  need_node "$node"
  pid=$(read_pid "$PIDS/slurmd-$node.pid")
  is_ours "$pid" || fail "slurmd $node is not running"
  # SIGKILL, not SIGTERM: the node must just go silent, like a hung or crashed daemon
  kill -KILL "$pid"
  rm -f "$PIDS/slurmd-$node.pid"
  log "stopped slurmd $node (pid $pid); its steps keep running"
}

cmd_start_node() {
  local node=$1 pid
  need_node "$node"
  pid=$(read_pid "$PIDS/slurmd-$node.pid")
  if is_ours "$pid"; then log "slurmd $node already running (pid $pid)"; return 0; fi
  start_slurmd "$node"
  log "started slurmd $node (pid $(read_pid "$PIDS/slurmd-$node.pid"))"
}

cmd_resume_node() {
  local node=$1
  need_node "$node"
  scontrol update nodename="$node" state=resume
  log "resumed $node"
}

cmd_stop_controller() {
  is_ours "$(read_pid "$PIDS/slurmctld.pid")" || fail "slurmctld is not running"
  stop_daemon "$PIDS/slurmctld.pid" slurmctld 15
}

cmd_start_controller() {
  if is_ours "$(read_pid "$PIDS/slurmctld.pid")"; then log "slurmctld already running"; return 0; fi
  # no -c: recover the saved jobs and node states, as a restarted production controller does
  slurmctld -f "$CONF" || fail "slurmctld did not start; see $LOGS/slurmctld.log"
  wait_until 30 slurmctld ctld_up
  log "started slurmctld"
}

usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; }

[ "$(id -u)" = 0 ] || fail "must run as root (unshare, /etc/hosts, apt-get)"
close_inherited_fds
case "${1:-}" in
  up) cmd_up "${2:-6}" ;;
  restart) cmd_down; cmd_up "${2:-6}" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  kill-node) cmd_kill_node "${2:-}" ;;
  start-node) cmd_start_node "${2:-}" ;;
  stop-slurmd) cmd_stop_slurmd "${2:-}" ;;
  resume-node) cmd_resume_node "${2:-}" ;;
  stop-controller) cmd_stop_controller ;;
  start-controller) cmd_start_controller ;;
  *) usage; exit 2 ;;
esac
