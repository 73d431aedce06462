#!/usr/bin/env bash
# A cluster of N hosts on this machine, for running commlayer across real (emulated) links.
#
#   bash scripts/cluster.sh up N [--rate 1gbit] [--delay 50us] [--loss 0%]
#   bash scripts/cluster.sh set nodeK [--rate R] [--delay D] [--loss L]   # change a link live
#   bash scripts/cluster.sh link nodeK down|up                            # pull/replug the cable
#   bash scripts/cluster.sh exec nodeK CMD [ARGS...]                      # run CMD on nodeK
#   bash scripts/cluster.sh status
#   bash scripts/cluster.sh down
#
# 1. Host nodeK is a network namespace named nodeK (interface eth0, address 10.213.0.K/24, no
#    default route: nothing outside the machine can be reached) plus a UTS namespace whose
#    hostname is nodeK, kept in $STATE/nodeK/uts. MPICH groups ranks into nodes by the host
#    hydra started them on (MPI_COMM_TYPE_SHARED follows it), commlayer by that and by
#    hostnames: both see N machines. Process ids, the file system and /dev/shm stay those of
#    the machine: ranks of one host share memory as on a real node, and a library that ignores
#    network namespaces could share it across hosts too (UCX does: see mpi.env below).
# 2. The switch is a bridge in a namespace of its own (cl-switch), not in the root namespace:
#    the root namespace gets no address and no route into 10.213.0.0/24, and the cluster none
#    out of it. So mpiexec runs on a host, the first of the job's, as on a cluster's login
#    node (commlayerrun does that), and reaches the others over the cluster's links.
# 3. Each host has one veth cable to the switch: eth0 inside the host, port-nodeK on the
#    switch. The link's rate, delay and loss apply in both directions, on eth0 (host -> switch)
#    and on port-nodeK (switch -> host): tbf for the rate, netem for the delay (where the kernel
#    has it), a BPF filter for the loss (see shape()).
# 4. Names: /etc/netns/nodeK/hosts lists every host; 'ip netns exec' (used by exec and by the
#    launcher) binds it over /etc/hosts for the processes it starts.
# 5. $STATE/launch is a launcher for MPICH's hydra in place of ssh; $STATE/mpi.env holds the
#    environment MPI jobs need on the cluster, that launcher included (commlayerrun -H
#    node1:2,node2:2 uses it and starts mpiexec on node1).
# 6. down removes everything up made: processes left inside the hosts, links, namespaces,
#    files. Every command is idempotent.
set -euo pipefail

STATE=/run/commlayer-cluster
SWITCH_NS=cl-switch
BRIDGE=switch0
SUBNET_PREFIX=10.213.0 # private (RFC 1918); host K is .K
MAX_HOSTS=250
DEFAULT_RATE=1gbit
DEFAULT_DELAY=0us
DEFAULT_LOSS=0%
IFACE=eth0 # inside each host

die() {
    echo "cluster.sh: $*" >&2
    exit 1
}

usage() {
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# Fail early and clearly where namespaces cannot be made (not root, a container without
# CAP_SYS_ADMIN, no iproute2).
check_permitted() {
    [[ $EUID -eq 0 ]] || die "needs root: network and UTS namespaces, veth links and tc (EUID is $EUID)"
    local tool
    for tool in ip tc nsenter unshare; do
        command -v "$tool" >/dev/null || die "'$tool' not found (apt install iproute2 util-linux)"
    done
    unshare --net --uts true 2>/dev/null ||
        die "network/UTS namespaces are not permitted here (unshare --net --uts failed)"
}

is_host() { [[ $1 =~ ^node([1-9][0-9]*)$ ]] && ((BASH_REMATCH[1] <= MAX_HOSTS)); }
host_index() { echo "${1#node}"; }
ns_exists() { [[ -e /run/netns/$1 ]] && ip netns list | grep -qx "$1\( (id: [0-9]*)\)\{0,1\}"; }
hosts_up() {
    local dir
    for dir in "$STATE"/node*/; do
        [[ -d $dir ]] && basename "$dir"
    done | sort -V
}

# Rate in bytes per second, from tc's notation (100mbit, 1gbit, 10gbit, 125mbps).
rate_bytes() {
    awk -v r="$1" 'BEGIN {
        r = tolower(r)
        if (r !~ /^[0-9]+(\.[0-9]+)?[kmgt]?(bit|bps)$/) exit 1
        match(r, /^[0-9.]+/); n = substr(r, 1, RLENGTH) + 0; u = substr(r, RLENGTH + 1)
        p = index("kmgt", substr(u, 1, 1)); f = p ? 10 ^ (3 * p) : 1
        printf "%.0f\n", n * f / (u ~ /bit$/ ? 8 : 1)
    }' || die "bad rate '$1': expected e.g. 100mbit, 1gbit, 10gbit"
}

# Classic BPF for tc's cls_bpf in direct-action mode: drop (TC_ACT_SHOT) when a random u32 is
# below loss * 2^32, else pass (TC_ACT_OK). The kernel here has neither netem nor gact.
loss_program() {
    awk -v l="${1%\%}" 'BEGIN {
        t = int(l / 100 * 4294967296); if (t > 4294967295) t = 4294967295
        # ld rand (SKF_AD_OFF + SKF_AD_RANDOM); jge #t ? pass : drop; ret #OK; ret #SHOT
        printf "4,32 0 0 4294963256,53 0 1 %.0f,6 0 0 0,6 0 0 2\n", t
    }'
}

is_zero() { awk -v v="$1" 'BEGIN { exit !(v + 0 == 0) }'; }

# Rate, delay and loss of one direction of a link (egress of one veth end):
# 1. rate: tbf at the root. Its burst is 1 ms at the rate but at least 128 KiB, so that a
#    64 KiB GSO packet of the veth passes whole (a smaller burst makes tbf cut it into MTU
#    packets: CPU the 2-core machine lacks); its queue holds 50 ms at the rate.
# 2. delay: netem as tbf's child, where the kernel has netem (not this one: then only 0).
# 3. loss: a classic BPF filter on the clsact egress hook dropping each packet (as the veth
#    carries it: a GSO packet of up to 64 KiB counts as one) with the given probability.
# 'replace' adds or changes in place, so the same call sets a link up and changes it live.
shape() {
    local ns=$1 dev=$2 rate=$3 delay=$4 loss=$5 burst bytes
    bytes=$(rate_bytes "$rate")
    burst=$((bytes / 1000 > 131072 ? bytes / 1000 : 131072))
    ip netns exec "$ns" tc qdisc replace dev "$dev" root handle 1: tbf \
        rate "$rate" burst "$burst" latency 50ms
    if ! is_zero "${delay%%[a-z]*}"; then
        ip netns exec "$ns" tc qdisc replace dev "$dev" parent 1:1 handle 10: netem \
            delay "$delay" limit 100000
    elif ip netns exec "$ns" tc qdisc show dev "$dev" | grep -q '^qdisc netem 10:'; then
        ip netns exec "$ns" tc qdisc replace dev "$dev" parent 1:1 handle 10: bfifo \
            limit $((bytes / 20 + burst))
    fi
    if ! ip netns exec "$ns" tc qdisc show dev "$dev" | grep -q '^qdisc clsact'; then
        ip netns exec "$ns" tc qdisc add dev "$dev" clsact
    fi
    if is_zero "${loss%\%}"; then
        ip netns exec "$ns" tc filter del dev "$dev" egress pref 1 2>/dev/null || true
    else
        ip netns exec "$ns" tc filter replace dev "$dev" egress pref 1 handle 1 bpf da \
            bytecode "$(loss_program "$loss")"
    fi
}

# Link settings of a host: rate delay loss, from $STATE/nodeK/link.
link_of() { cat "$STATE/$1/link"; }

shape_link() {
    local host=$1 rate=$2 delay=$3 loss=$4
    shape "$host" "$IFACE" "$rate" "$delay" "$loss"
    shape "$SWITCH_NS" "port-$host" "$rate" "$delay" "$loss"
    echo "$rate $delay $loss" >"$STATE/$host/link"
}

write_hosts_file() {
    local k
    {
        echo "127.0.0.1 localhost"
        for k in $(seq 1 "$1"); do echo "$SUBNET_PREFIX.$k node$k"; done
    } >"$STATE/hosts"
    for k in $(seq 1 "$1"); do
        mkdir -p "/etc/netns/node$k"
        cp "$STATE/hosts" "/etc/netns/node$k/hosts"
    done
}

# hydra's launcher: called as 'launch [ssh options] HOST COMMAND...', as ssh would be; runs the
# command (one shell string, as ssh passes it) on HOST.
write_launcher() {
    cat >"$STATE/launch" <<EOF
#!/usr/bin/env bash
# Written by scripts/cluster.sh: enters host \$HOST of the cluster in place of ssh.
set -euo pipefail
while [[ \$# -gt 0 && \$1 == -* ]]; do
    case \$1 in -[lopiFJ]) shift 2 ;; *) shift ;; esac
done
[[ \$# -ge 2 ]] || { echo "launch: usage: launch [ssh options] HOST COMMAND" >&2; exit 2; }
host=\$1
shift
[[ -e $STATE/\$host/uts ]] || { echo "launch: \$host is not a host of the cluster (scripts/cluster.sh status)" >&2; exit 255; }
exec ip netns exec "\$host" nsenter --uts=$STATE/\$host/uts -- /bin/sh -c "\$*"
EOF
    chmod 755 "$STATE/launch"
    # What MPI jobs need on the cluster (commlayerrun applies it; with plain mpiexec:
    # env $(cat $STATE/mpi.env) bash scripts/cluster.sh exec node1 mpiexec -hosts ...):
    # - HYDRA_*: hydra starts its proxy on other hosts through the launcher, and the proxies
    #   connect back to mpiexec over the cluster's network.
    # - UCX_TLS: without it the mpich wheel's UCX reaches the other hosts through shared memory
    #   (its sm transports ignore network namespaces) and no byte crosses the links; with
    #   tcp,self MPICH's own shared memory still serves the ranks of one host (measured:
    #   nothing on lo or eth0 between them).
    # - UCX_NET_DEVICES: the cable, not lo (127.0.0.1 is another machine in every host).
    cat >"$STATE/mpi.env" <<EOF
HYDRA_LAUNCHER=ssh
HYDRA_LAUNCHER_EXEC=$STATE/launch
HYDRA_IFACE=$IFACE
UCX_TLS=tcp,self
UCX_NET_DEVICES=$IFACE
EOF
}

add_host() {
    local host=$1 k
    k=$(host_index "$host")
    mkdir -p "$STATE/$host"
    if ! ns_exists "$host"; then
        ip netns add "$host"
    fi
    if ! ip netns exec "$host" ip link show "$IFACE" >/dev/null 2>&1; then
        ip -n "$SWITCH_NS" link del "port-$host" 2>/dev/null || true
        # made inside the two namespaces: no end ever appears in the root namespace
        ip -n "$host" link add "$IFACE" type veth peer name "port-$host" netns "$SWITCH_NS"
        ip -n "$host" addr add "$SUBNET_PREFIX.$k/24" dev "$IFACE"
        ip -n "$host" link set lo up
        ip -n "$host" link set "$IFACE" up
        ip -n "$SWITCH_NS" link set "port-$host" master "$BRIDGE" up
    fi
    if ! mountpoint -q "$STATE/$host/uts" 2>/dev/null; then
        touch "$STATE/$host/uts"
        unshare --uts="$STATE/$host/uts" hostname "$host"
    fi
}

remove_host() {
    local host=$1
    kill_inside "$host"
    ip -n "$SWITCH_NS" link del "port-$host" 2>/dev/null || true
    if ns_exists "$host"; then ip netns del "$host"; fi
    if mountpoint -q "$STATE/$host/uts" 2>/dev/null; then umount "$STATE/$host/uts"; fi
    rm -rf "${STATE:?}/$host" "/etc/netns/$host"
}

# Processes still running in a host (a job that outlived its launcher): TERM, then KILL.
kill_inside() {
    local host=$1 pids i
    ns_exists "$host" || return 0
    for i in 1 2 3 4 5 6 7 8 9 10 11; do
        pids=$(ip netns pids "$host" 2>/dev/null || true)
        [[ -n $pids ]] || return 0
        if ((i == 1)); then
            echo "cluster.sh: stopping processes left on $host: $(echo $pids)" >&2
            kill -TERM $pids 2>/dev/null || true
        elif ((i >= 6)); then
            kill -KILL $pids 2>/dev/null || true
        fi
        sleep 0.2
    done
    die "processes on $host would not end: $(ip netns pids "$host" | tr '\n' ' ')"
}

parse_link_options() {
    RATE=$1 DELAY=$2 LOSS=$3
    shift 3
    while [[ $# -gt 0 ]]; do
        [[ $# -ge 2 ]] || die "option $1 needs a value"
        case $1 in
        --rate) RATE=$2 ;;
        --delay) DELAY=$2 ;;
        --loss) LOSS=$2 ;;
        *) die "unknown option $1 (expected --rate, --delay, --loss)" ;;
        esac
        shift 2
    done
    rate_bytes "$RATE" >/dev/null
    [[ $DELAY =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]] || die "bad delay '$DELAY': expected e.g. 50us, 2ms"
    # Checked before any link changes: in a namespace of its own, on its loopback.
    if ! is_zero "${DELAY%%[a-z]*}" && ! unshare --net tc qdisc add dev lo root netem delay 1ms 2>/dev/null; then
        die "--delay $DELAY needs netem, which this kernel lacks (CONFIG_NET_SCH_NETEM); use --delay 0us"
    fi
    [[ $LOSS =~ ^[0-9]+(\.[0-9]+)?%$ ]] || die "bad loss '$LOSS': expected e.g. 0%, 5%, 0.1%"
}

cmd_up() {
    [[ $# -ge 1 && $1 =~ ^[1-9][0-9]*$ ]] || die "usage: cluster.sh up N [--rate R] [--delay D] [--loss L]"
    local n=$1 host k
    shift
    ((n <= MAX_HOSTS)) || die "at most $MAX_HOSTS hosts (addresses $SUBNET_PREFIX.1-$MAX_HOSTS)"
    parse_link_options "$DEFAULT_RATE" "$DEFAULT_DELAY" "$DEFAULT_LOSS" "$@"
    check_permitted
    for k in $(seq 1 "$n"); do
        if ns_exists "node$k" && [[ ! -d $STATE/node$k ]]; then
            die "a network namespace node$k exists that this script did not make; remove it first"
        fi
    done
    mkdir -p "$STATE"
    [[ -d /etc/netns ]] || { mkdir /etc/netns && touch "$STATE/made-etc-netns"; }
    if ! ns_exists "$SWITCH_NS"; then ip netns add "$SWITCH_NS"; fi
    if ! ip -n "$SWITCH_NS" link show "$BRIDGE" >/dev/null 2>&1; then
        ip -n "$SWITCH_NS" link add "$BRIDGE" type bridge
        ip -n "$SWITCH_NS" link set "$BRIDGE" up
    fi
    for host in $(hosts_up); do # fewer hosts than before: the extra ones go
        (($(host_index "$host") <= n)) || remove_host "$host"
    done
    for k in $(seq 1 "$n"); do
        add_host "node$k"
        shape_link "node$k" "$RATE" "$DELAY" "$LOSS"
    done
    write_hosts_file "$n"
    write_launcher
    echo "cluster up: node1..node$n on $SUBNET_PREFIX.0/24, links $RATE, delay $DELAY, loss $LOSS"
}

cmd_down() {
    local host
    if [[ ! -d $STATE ]] && ! ns_exists "$SWITCH_NS"; then
        echo "cluster down (nothing was up)"
        return 0
    fi
    check_permitted
    if [[ -d $STATE ]]; then
        for host in $(hosts_up); do remove_host "$host"; done
    fi
    if ns_exists "$SWITCH_NS"; then ip netns del "$SWITCH_NS"; fi
    if [[ -e $STATE/made-etc-netns ]]; then rmdir /etc/netns 2>/dev/null || true; fi
    rm -rf "$STATE"
    echo "cluster down"
}

require_host() {
    is_host "${1:-}" || die "expected a host name node1..node$MAX_HOSTS, got '${1:-}'"
    [[ -d $STATE/$1 ]] || die "$1 is not up (cluster.sh status)"
    check_permitted
}

cmd_set() {
    require_host "${1:-}"
    local host=$1 current
    shift
    read -r -a current <<<"$(link_of "$host")"
    parse_link_options "${current[@]}" "$@"
    shape_link "$host" "$RATE" "$DELAY" "$LOSS"
    echo "$host: rate $RATE, delay $DELAY, loss $LOSS"
}

cmd_link() {
    require_host "${1:-}"
    [[ ${2:-} == up || ${2:-} == down ]] || die "usage: cluster.sh link nodeK down|up"
    # The switch's end: the host's eth0 loses its carrier, as when a cable is pulled.
    ip -n "$SWITCH_NS" link set "port-$1" "$2"
    echo "$1: link $2"
}

cmd_exec() {
    require_host "${1:-}"
    local host=$1
    shift
    [[ $# -ge 1 ]] || die "usage: cluster.sh exec nodeK CMD [ARGS...]"
    exec ip netns exec "$host" nsenter --uts="$STATE/$host/uts" -- "$@"
}

cmd_status() {
    local host rate delay loss
    if [[ ! -d $STATE ]] || [[ -z $(hosts_up) ]]; then
        echo "cluster: down"
        return 0
    fi
    check_permitted
    echo "cluster: $(hosts_up | wc -l) hosts on $SUBNET_PREFIX.0/24, switch $BRIDGE in namespace $SWITCH_NS"
    for host in $(hosts_up); do
        read -r rate delay loss <<<"$(link_of "$host")"
        echo
        echo "$host  $SUBNET_PREFIX.$(host_index "$host")  hostname $(nsenter --uts="$STATE/$host/uts" hostname)" \
            " link $rate delay $delay loss $loss  processes $(ip netns pids "$host" | wc -l)"
        echo "  $host:$IFACE -> switch: $(counters "$host" "$IFACE")"
        ip netns exec "$host" tc -s qdisc show dev "$IFACE" | sed 's/^/    /'
        echo "  switch:port-$host -> $host: $(counters "$SWITCH_NS" "port-$host")"
        ip netns exec "$SWITCH_NS" tc -s qdisc show dev "port-$host" | sed 's/^/    /'
    done
}

# One line: state, bytes and packets sent and received, from the kernel's counters.
counters() {
    ip -n "$1" -s -o link show dev "$2" | awk '{
        for (i = 1; i <= NF; i++) { if ($i == "state") state = $(i + 1) }
        for (i = 1; i <= NF; i++) if ($i == "RX:") rx = i; else if ($i == "TX:") tx = i
        printf "%s, sent %s bytes %s packets (%s dropped), received %s bytes %s packets", state,
            $(tx + 8), $(tx + 9), $(tx + 11), $(rx + 8), $(rx + 9)
    }'
}

main() {
    [[ $# -ge 1 ]] || usage
    # not root: run again through sudo (scripts/as-root.sh), so that one command line serves a
    # root user and a sudo user
    if [[ $EUID -ne 0 && $1 != -h && $1 != --help && $1 != help ]] && command -v sudo >/dev/null; then
        exec bash "$(dirname "$0")/as-root.sh" bash "$0" "$@"
    fi
    local command=$1
    shift
    case $command in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    set) cmd_set "$@" ;;
    link) cmd_link "$@" ;;
    exec) cmd_exec "$@" ;;
    status) cmd_status ;;
    -h | --help | help) usage ;;
    *) die "unknown command '$command' (up, down, set, link, exec, status)" ;;
    esac
}

main "$@"
