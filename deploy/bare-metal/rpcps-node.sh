#!/usr/bin/env bash
# rpcps-node.sh: starts the rpcps processes of one node and keeps them running.
#
#   rpcps-node.sh server  [options] [-- more 'rpcps ps' flags]
#   rpcps-node.sh workers --ps HOST:PORT [options] [-- more 'rpcps worker' flags]
#   rpcps-node.sh store   [options] [-- more 'rpcps store' flags]   (the coordinator, for standbys)
#
# Run on each node, by hand, from systemd (rpcps-server.service, rpcps-worker@.service), from
# Slurm (deploy/slurm/rpcps.sbatch) or inside `ip netns exec` in tests/integration/deploy/test_multihost.py.
# `rpcps-node.sh --help` lists every option; docs/DEPLOY.md walks through each target.
#
# Settings: flag > environment (an --env-file is read first) > default. rpcps itself reads every
# other RPCPS_<FLAG> variable, so an env file can carry any rpcps setting
# (deploy/bare-metal/rpcps.env.example).
set -uo pipefail

prog=rpcps-node.sh
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

usage() {
    cat <<'EOF'
usage: rpcps-node.sh server  [options] [-- more 'rpcps ps' flags]
       rpcps-node.sh workers --ps HOST:PORT [options] [-- more 'rpcps worker' flags]
       rpcps-node.sh store   [options] [-- more 'rpcps store' flags]

Starts the parameter server, this node's workers, or the group's coordinator (rpcps store: a job
whose servers have a hot standby needs one), and restarts a process that crashes (with
backoff). A process that exits 0 is done (a worker finished its steps; a server was stopped).
Exit codes 2 (bad setting), 4 (bad gradients) and 5 (refused by the server) are not retried:
restarting cannot fix them.

options (flag / environment variable / default):
  --env-file FILE        RPCPS_ENV_FILE              KEY=VALUE file read first (systemd EnvironmentFile format)
  --log-dir DIR          RPCPS_LOG_DIR               /var/log/rpcps; '-' writes to this script's
                                                     stdout/stderr (the journal under systemd)
  --python PY            RPCPS_PYTHON                python3 (an interpreter with rpcps installed)
  --ifname IF            TP_SOCKET_IFNAME            the interface whose address TensorPipe gives its
                                                     peers (default: the address the hostname resolves to)
  --max-restarts N       RPCPS_MAX_RESTARTS          10 restarts in a row (a run that stayed up for
                                                     --stable-s resets the count); 0 never restarts
  --backoff-s S          RPCPS_RESTART_BACKOFF_S     1 first delay before a restart, doubling ...
  --backoff-max-s S      RPCPS_RESTART_BACKOFF_MAX_S 60 ... up to this
  --stable-s S           RPCPS_RESTART_STABLE_S      600
  --memory-max-mb M      RPCPS_MEMORY_MAX_MB         0 (none): cap each process's heap (ulimit -d). A message
                                                     too large to allocate then ends in a crash and a
                                                     restart from the newest snapshot, not in swapping
                                                     the node; under systemd prefer the unit's MemoryMax=
  --no-supervise         RPCPS_SUPERVISE=0           run one process in place (exec), no restarts:
                                                     for systemd or any other supervisor, which then
                                                     owns every restart
  Either way the server runs with 'rpcps ps --supervise off': one layer restarts it, this launcher
  or what runs it in place (docs/DEPLOY.md, "Who restarts what"), never also rpcps ps's own supervisor.
  --dry-run                                          print the commands and exit

server:
  --listen HOST:PORT     RPCPS_LISTEN                0.0.0.0:29500 (the torch RPC port: training network only;
                                                     rpcps then needs RPCPS_TRUST_NETWORK=on and
                                                     RPCPS_JOB_SECRET_FILE, see docs/SECURITY.md)
  --checkpoint-dir DIR   RPCPS_CHECKPOINT_DIR        /var/lib/rpcps/checkpoints (resume is automatic)
  --metrics-port P       RPCPS_METRICS_PORT          9400
  --control-port P       RPCPS_CONTROL_PORT          9500
  --store HOST:PORT      RPCPS_STORE                 unset (this server hosts the group's store at --listen);
                                                     the coordinator's address: join its group instead; or
                                                     etcd://HOST:PORT[,HOST:PORT...]/PREFIX: the group's
                                                     store in an etcd cluster (no coordinator)
  --replicas N           RPCPS_REPLICAS              1; 2 keeps a hot standby per shard: run the same server
                                                     command on a second node (needs --store). On one node,
                                                     give the second other --metrics-port/--control-port

store (the coordinator; servers pass its address as --store, workers as --ps):
  --listen HOST:PORT     RPCPS_STORE                 0.0.0.0:29400 (a torch RPC port: training network
                                                     only, like the server's --listen)
  --metrics-port P       RPCPS_STORE_METRICS_PORT    9390 (not RPCPS_METRICS_PORT: an env file shared with
                                                     the server sets that for the server)

workers (worker i of this node, i = 0..count-1):
  --ps HOST:PORT         RPCPS_PS                    required: the server's --listen address (the
                                                     coordinator's with replicas; the servers' etcd:// URL
                                                     when the store is in etcd)
  --count N              RPCPS_NODE_WORKERS          1 workers on this node
  --first-index K        RPCPS_FIRST_INDEX           0 slot of this node's local worker 0
  --local-index L        RPCPS_LOCAL_INDEX           0 local index of the first worker started here
                                                     (slot = K + L + i; systemd passes its instance)
  --num-workers W        RPCPS_NUM_WORKERS           count when K = L = 0, else required: slots in the job
  --metrics-port-base P  RPCPS_METRICS_PORT_BASE     9410 (worker /metrics on P + L + i)
  each worker also gets LOCAL_RANK=L+i, so --device auto takes GPU L+i.

workers --torchrun (torchrun starts --count processes per node and restarts them):
  --nnodes N             RPCPS_NNODES                1 (--standalone rendezvous when 1)
  --rdzv-endpoint H:P    RPCPS_RDZV_ENDPOINT         torchrun's rendezvous, required when N > 1;
                                                     not the server's port
  --rdzv-id ID           RPCPS_RDZV_ID               rpcps
  Slots and slot count come from torchrun's RANK and WORLD_SIZE, /metrics is on 9410 + LOCAL_RANK.
  --ps is required: torchrun's MASTER_ADDR/MASTER_PORT are its own store, not the parameter server.

logs: DIR/ps.log, DIR/store.log, DIR/worker<slot>.log, DIR/torchrun.log (+ DIR/torchrun/ per rank); each holds the
process's output and this script's start/exit/restart lines.
EOF
}

die() {
    echo "$prog: error: $*" >&2
    exit 2
}

role=${1:-}
case $role in
    server | workers | store) shift ;;
    -h | --help | help) usage; exit 0 ;;
    "") usage >&2; exit 2 ;;
    *) die "unknown role '$role'; use 'server', 'workers' or 'store' (see $prog --help)" ;;
esac

common_flags=" env-file log-dir python ifname max-restarts backoff-s backoff-max-s stable-s memory-max-mb no-supervise dry-run "
server_flags=" listen checkpoint-dir metrics-port control-port store replicas "
worker_flags=" ps count first-index local-index num-workers metrics-port-base torchrun nnodes rdzv-endpoint rdzv-id "
store_flags=" listen metrics-port "
switches=" no-supervise dry-run torchrun "
case $role in
    server) known="$common_flags$server_flags" ;;
    workers) known="$common_flags$worker_flags" ;;
    store) known="$common_flags$store_flags" ;;
esac

declare -A opt=()
extra=()
while (($#)); do
    case $1 in
        --) shift; extra=("$@"); break ;;
        -h | --help) usage; exit 0 ;;
        --*)
            key=${1#--}
            value=
            if [[ $key == *=* ]]; then value=${key#*=}; key=${key%%=*}; fi
            [[ $known == *" $key "* ]] || die "unknown option --$key for '$role' (see $prog --help); flags for rpcps itself go after '--'"
            if [[ $switches == *" $key "* ]]; then
                opt[$key]=1
            elif [[ $1 == *=* ]]; then
                opt[$key]=$value
            else
                (($# >= 2)) || die "--$key needs a value"
                value=$2
                opt[$key]=$value
                shift
            fi
            shift
            ;;
        *) die "unexpected argument '$1'; flags for rpcps itself go after '--'" ;;
    esac
done

env_file=${opt[env-file]:-${RPCPS_ENV_FILE:-}}
if [ -n "$env_file" ]; then
    [ -r "$env_file" ] || die "cannot read --env-file $env_file"
    set -a
    # shellcheck source=/dev/null
    . "$env_file" || die "--env-file $env_file has a syntax error (KEY=VALUE lines)"
    set +a
fi

# setting FLAG ENVVAR DEFAULT: prints the value, flag > environment > default.
setting() {
    local env_value=
    [ -n "$2" ] && env_value=${!2:-}
    printf '%s' "${opt[$1]:-${env_value:-$3}}"
}
is_uint() { [[ $1 =~ ^(0|[1-9][0-9]*)$ ]]; }
need_uint() { is_uint "$2" || die "$1 must be a whole number >= 0 (no leading zeros), got '$2'"; }
need_port() {
    need_uint "$1" "$2"
    (($2 <= 65535)) || die "$1 must be a port in [0, 65535], got '$2'"
}
need_host_port() {
    [[ $2 =~ ^(\[[0-9a-fA-F:.]+\]|[^:]+):([0-9]+)$ ]] || die "$1 must be HOST:PORT, got '$2'"
    need_port "$1's port" "${BASH_REMATCH[2]}"
}
# need_store FLAG VALUE: HOST:PORT (a server or the coordinator) or etcd://HOST:PORT[,HOST:PORT...]/PREFIX.
need_store() {
    if [[ $2 == etcd://* ]]; then
        [[ $2 =~ ^etcd://([^/]+)/(.+)$ ]] || die "$1 must be etcd://HOST:PORT[,HOST:PORT...]/PREFIX (a prefix of the job's own), got '$2'"
        local endpoint
        local -a endpoints
        IFS=, read -ra endpoints <<<"${BASH_REMATCH[1]}"
        for endpoint in "${endpoints[@]}"; do
            [[ $endpoint =~ ^(\[[0-9a-fA-F:.]+\]|[^:]+):([0-9]+)$ ]] ||
                die "$1: each etcd endpoint must be HOST:PORT, got '$endpoint' in '$2'"
            need_port "$1's etcd port" "${BASH_REMATCH[2]}"
        done
    else
        need_host_port "$@"
    fi
}

log_dir=$(setting log-dir RPCPS_LOG_DIR /var/log/rpcps)
python=$(setting python RPCPS_PYTHON python3)
ifname=$(setting ifname TP_SOCKET_IFNAME "")
max_restarts=$(setting max-restarts RPCPS_MAX_RESTARTS 10)
backoff_s=$(setting backoff-s RPCPS_RESTART_BACKOFF_S 1)
backoff_max_s=$(setting backoff-max-s RPCPS_RESTART_BACKOFF_MAX_S 60)
stable_s=$(setting stable-s RPCPS_RESTART_STABLE_S 600)
memory_max_mb=$(setting memory-max-mb RPCPS_MEMORY_MAX_MB 0)
need_uint --max-restarts "$max_restarts"
need_uint --memory-max-mb "$memory_max_mb"
need_uint --backoff-s "$backoff_s"
need_uint --backoff-max-s "$backoff_max_s"
need_uint --stable-s "$stable_s"
supervise=1
case ${RPCPS_SUPERVISE:-1} in 0 | false | no) supervise=0 ;; esac
[ -n "${opt[no-supervise]:-}" ] && supervise=0
dry_run=${opt[dry-run]:-0}

if [ -n "$ifname" ]; then
    # TensorPipe gives its peers the address of this interface; with the wrong one peers connect to
    # themselves (127.0.0.1 when the hostname resolves to loopback) and joins fail with ECONNREFUSED.
    [ -e "/sys/class/net/$ifname" ] || die "--ifname $ifname: no such network interface here (see: ip -br link)"
    export TP_SOCKET_IFNAME=$ifname
fi
command -v "$python" >/dev/null 2>&1 || die "--python $python not found; point --python or RPCPS_PYTHON at the interpreter rpcps is installed in"

# The repository's entry point when this script runs from a checkout, else the installed module.
if [ -f "$repo/trainer_entry.py" ]; then entry=("$repo/trainer_entry.py"); else entry=(-m trainer_entry); fi
# Set by rpcps processes when they restart themselves in place, and by this launcher for a server it
# restarts; a stale value must not leak into a fresh process (a worker would count old reconnects, a
# server would resume a specific snapshot or report restarts it never had).
unset RPCPS_RECONNECTS RPCPS_RESTART_FROM RPCPS_CRASH_RESTARTS

names=()
logs=()
cmds=() # one command per process, as a quoted string for eval-free storage below
envs=()

add_process() { # name log env-assignment cmd...
    names+=("$1")
    logs+=("$2")
    envs+=("$3")
    shift 3
    cmds+=("$(printf '%q ' "$@")")
}

log_for() { if [ "$log_dir" = - ]; then echo -; else echo "$log_dir/$1.log"; fi; }

if [ "$role" = server ]; then
    listen=$(setting listen RPCPS_LISTEN 0.0.0.0:29500)
    checkpoint_dir=$(setting checkpoint-dir RPCPS_CHECKPOINT_DIR /var/lib/rpcps/checkpoints)
    metrics_port=$(setting metrics-port RPCPS_METRICS_PORT 9400)
    control_port=$(setting control-port RPCPS_CONTROL_PORT 9500)
    need_host_port --listen "$listen"
    need_port --metrics-port "$metrics_port"
    need_port --control-port "$control_port"
    store=$(setting store RPCPS_STORE "")
    replicas=$(setting replicas RPCPS_REPLICAS 1)
    need_uint --replicas "$replicas"
    ((replicas >= 1)) || die "--replicas must be >= 1, got $replicas"
    replication=()
    if [ -n "$store" ]; then
        need_store --store "$store"
        replication=(--store "$store")
    elif ((replicas > 1)); then
        die "--replicas $replicas needs --store HOST:PORT or etcd://...: a standby cannot take over from a primary that hosts the group's store; start '$prog store' and pass its address, or keep the store in etcd"
    fi
    ((replicas > 1)) && replication+=(--replicas "$replicas")
    # --supervise off: this launcher (or, with --no-supervise, systemd) restarts the server; its own
    # supervisor under it would be a second layer with its own backoff and give-up rule.
    add_process ps "$(log_for ps)" "" "$python" "${entry[@]}" ps --listen "$listen" --checkpoint-dir "$checkpoint_dir" \
        --metrics-port "$metrics_port" --control-port "$control_port" "${replication[@]}" --supervise off "${extra[@]}"
elif [ "$role" = store ]; then
    listen=$(setting listen RPCPS_STORE 0.0.0.0:29400)
    metrics_port=$(setting metrics-port RPCPS_STORE_METRICS_PORT 9390)
    need_host_port --listen "$listen"
    need_port --metrics-port "$metrics_port"
    add_process store "$(log_for store)" "" "$python" "${entry[@]}" store --listen "$listen" --metrics-port "$metrics_port" "${extra[@]}"
else
    ps=$(setting ps RPCPS_PS "")
    count=$(setting count RPCPS_NODE_WORKERS 1)
    first_index=$(setting first-index RPCPS_FIRST_INDEX 0)
    local_index=$(setting local-index RPCPS_LOCAL_INDEX 0)
    metrics_base=$(setting metrics-port-base RPCPS_METRICS_PORT_BASE 9410)
    [ -n "$ps" ] || die "--ps HOST:PORT is required: the server's --listen address (torchrun's MASTER_ADDR/MASTER_PORT is not it)"
    need_store --ps "$ps"
    need_uint --count "$count"
    ((count >= 1)) || die "--count must be >= 1, got $count"
    if [ -n "${opt[torchrun]:-}" ]; then
        nnodes=$(setting nnodes RPCPS_NNODES 1)
        rdzv_endpoint=$(setting rdzv-endpoint RPCPS_RDZV_ENDPOINT "")
        rdzv_id=$(setting rdzv-id RPCPS_RDZV_ID rpcps)
        need_uint --nnodes "$nnodes"
        ((nnodes >= 1)) || die "--nnodes must be >= 1"
        rdzv=(--standalone)
        if ((nnodes > 1)); then
            [ -n "$rdzv_endpoint" ] || die "--rdzv-endpoint HOST:PORT is required with --nnodes > 1 (torchrun's rendezvous, e.g. the first node and a free port)"
            need_host_port --rdzv-endpoint "$rdzv_endpoint"
            rdzv=(--rdzv-backend c10d --rdzv-endpoint "$rdzv_endpoint" --rdzv-id "$rdzv_id")
        fi
        tr_logs=()
        [ "$log_dir" = - ] || tr_logs=(--log-dir "$log_dir/torchrun" --tee 3)
        # RANK/WORLD_SIZE/LOCAL_RANK must decide the slot, the slot count and the metrics port: a
        # value from an env file shared by all ranks would put every rank in the same slot.
        unset RPCPS_WORKER_INDEX RPCPS_NUM_WORKERS RPCPS_METRICS_PORT
        if [ "${entry[0]}" = -m ]; then script=(-m trainer_entry); else script=("${entry[@]}"); fi
        add_process torchrun "$(log_for torchrun)" "" "$python" -m torch.distributed.run --nnodes "$nnodes" \
            --nproc-per-node "$count" "${rdzv[@]}" --max-restarts "$max_restarts" "${tr_logs[@]}" \
            "${script[@]}" worker --ps "$ps" "${extra[@]}"
        supervise=0 # torchrun restarts its workers itself
    else
        if [ -n "${opt[num-workers]:-}${RPCPS_NUM_WORKERS:-}" ]; then
            num_workers=$(setting num-workers RPCPS_NUM_WORKERS "")
        elif ((first_index == 0 && local_index == 0)); then
            num_workers=$count
        else
            die "--num-workers is required when --first-index or --local-index is set (the job's slot count, same on every node)"
        fi
        need_uint --first-index "$first_index"
        need_uint --local-index "$local_index"
        need_uint --num-workers "$num_workers"
        need_port --metrics-port-base "$metrics_base"
        for ((i = 0; i < count; i++)); do
            local_rank=$((local_index + i))
            slot=$((first_index + local_rank))
            ((slot < num_workers)) || die "slot $slot (--first-index $first_index + local index $local_rank) is not below --num-workers $num_workers"
            port=$((metrics_base + local_rank))
            ((port <= 65535)) || die "--metrics-port-base $metrics_base + $local_rank is beyond port 65535"
            add_process "worker$slot" "$(log_for "worker$slot")" "LOCAL_RANK=$local_rank" "$python" "${entry[@]}" worker \
                --ps "$ps" --worker-index "$slot" --num-workers "$num_workers" --metrics-port "$port" "${extra[@]}"
        done
    fi
fi

if ((memory_max_mb > 0)); then
    # RLIMIT_DATA counts heap and private mappings (what torch allocates tensors from), not the
    # address space CUDA reserves; every process started below inherits it.
    if ((dry_run)); then
        echo "ulimit -d $((memory_max_mb * 1024))"
    else
        ulimit -d $((memory_max_mb * 1024)) || die "cannot set --memory-max-mb $memory_max_mb (ulimit -d): above the hard limit?"
    fi
fi

if ((dry_run)); then
    for k in "${!names[@]}"; do
        echo "${envs[$k]:+${envs[$k]} }${cmds[$k]% } > ${logs[$k]}"
    done
    exit 0
fi

if [ "$log_dir" != - ]; then
    { mkdir -p "$log_dir" 2>/dev/null && [ -w "$log_dir" ]; } ||
        die "cannot write to log directory $log_dir; pick another with --log-dir or RPCPS_LOG_DIR ('-' logs to stdout)"
fi

note() { # name log message...: to stderr, and into the process's own log so it tells the whole story
    local line
    line="$(date '+%Y-%m-%d %H:%M:%S') ${prog}[$$]: $1: ${*:3}"
    echo "$line" >&2
    [ "$2" = - ] || echo "$line" >>"$2"
}

meaning() {
    case $1 in
        1) echo "could not start: port in use, server unreachable or I/O error" ;;
        2) echo "bad flag or setting, or resume refused" ;;
        3) echo "lost the server and gave up reconnecting" ;;
        4) echo "too many pushes in a row rejected" ;;
        5) echo "refused by the server: different model, slot out of range or taken over" ;;
        6) echo "finished, but the server could not make its last steps durable (checkpoint write failing)" ;;
        *) if (($1 > 128)); then echo "killed by signal $(($1 - 128))"; else echo "failed"; fi ;;
    esac
}

# run_one K: runs process K in place of this shell (no supervision).
run_one() {
    local k=$1
    note "${names[$k]}" "${logs[$k]}" "exec ${cmds[$k]}"
    [ -n "${envs[$k]}" ] && export "${envs[$k]?}"
    if [ "${logs[$k]}" = - ]; then
        eval "exec ${cmds[$k]}"
    else
        eval "exec ${cmds[$k]} >>\"\${logs[\$k]}\" 2>&1"
    fi
}

# supervise K: runs process K until it finishes, restarting it with backoff. Returns its final code
# (0 when it finished or was stopped by a signal to this script).
supervise() {
    local k=$1 name=${names[$1]} log=${logs[$1]}
    local restarts=0 total=0 delay=$backoff_s rc started child="" session
    local stopping=0
    trap 'stopping=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
    [ -n "${envs[$k]}" ] && export "${envs[$k]?}"
    while :; do
        started=$SECONDS
        # rpcps ps reports this as rpcps_server_crash_restarts (what its own supervisor would set), so
        # the RpcpsServerCrashRestarted alert sees this launcher's restarts.
        [ "$name" = ps ] && export RPCPS_CRASH_RESTARTS=$total
        # The server in a session of its own, as `rpcps ps` by hand and `rpcps local` start it: under
        # the kernel's autogroup scheduling a session is a scheduling group, so the server's short
        # bursts do not queue behind the workers' compute threads (ps/lifecycle/supervisor.py). A
        # background job of this script leads no process group, so setsid execs in place: $! is the server.
        session=""
        [ "$name" = ps ] && command -v setsid >/dev/null && session="setsid "
        if [ "$log" = - ]; then
            eval "$session${cmds[$k]} &"
        else
            eval "$session${cmds[$k]} >>\"\$log\" 2>&1 &"
        fi
        child=$!
        note "$name" "$log" "started pid $child: ${cmds[$k]}"
        wait "$child"
        rc=$?
        # A trapped signal interrupts wait (status > 128) while the child may still be stopping.
        while ((rc > 128)) && kill -0 "$child" 2>/dev/null; do
            wait "$child"
            rc=$?
        done
        child=""
        if ((stopping)); then
            note "$name" "$log" "stopped (exit $rc)"
            return 0
        fi
        if ((rc == 0)); then
            note "$name" "$log" "finished"
            return 0
        fi
        case $rc in
            2 | 4 | 5)
                note "$name" "$log" "exited with $rc ($(meaning "$rc")); not restarting it, a restart cannot fix this"
                return "$rc"
                ;;
        esac
        if ((SECONDS - started >= stable_s)); then # it ran fine for a while: a new failure, not a crash loop
            restarts=0
            delay=$backoff_s
        fi
        if ((restarts >= max_restarts)); then
            note "$name" "$log" "exited with $rc ($(meaning "$rc")) and is out of restarts ($max_restarts in a row)"
            return "$rc"
        fi
        restarts=$((restarts + 1))
        total=$((total + 1))
        note "$name" "$log" "exited with $rc ($(meaning "$rc")); restart $restarts/$max_restarts in ${delay}s"
        sleep "$delay" &
        child=$!
        wait "$child"
        child=""
        ((stopping)) && return 0
        delay=$((delay * 2 > backoff_max_s ? backoff_max_s : delay * 2))
    done
}

if ((!supervise)); then
    ((${#names[@]} == 1)) || die "--no-supervise runs one process; use --count 1 (one systemd unit per worker)"
    run_one 0
fi

if ((${#names[@]} == 1)); then
    supervise 0
    exit $?
fi

pids=()
interrupted=0
trap 'interrupted=1; ((${#pids[@]})) && kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
for k in "${!names[@]}"; do
    supervise "$k" &
    pids+=($!)
done
# A signal that came while they started reached only the supervisors started before it.
((interrupted)) && kill -TERM "${pids[@]}" 2>/dev/null
status=0
for pid in "${pids[@]}"; do
    while :; do
        wait "$pid"
        rc=$?
        # The trap above interrupts wait (status > 128) whether or not that supervisor has ended
        # meanwhile, and its own status is still there to collect: wait again. (Asking whether it
        # still ran took the interruption's 143 for the status of one that had just stopped: CI.)
        if ((rc > 128 && interrupted)); then
            interrupted=0
            continue
        fi
        break
    done
    ((rc != 0 && status == 0)) && status=$rc
done
exit "$status"
