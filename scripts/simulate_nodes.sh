#!/usr/bin/env bash
# Several "machines" on this one: each node is a network namespace with its own loopback, joined
# to the others through a switch (a bridge in a namespace of its own) by a link whose bandwidth
# (and, where the kernel has netem, delay) is shaped in both directions. The ranks of a node
# talk over its loopback, unshaped, as ranks on one machine do; everything between nodes crosses
# the shaped links, as it would cross a network. Runs scripts/launch.sh in every node with the
# multi-node variables set (NNODES, NODE_RANK, MASTER_ADDR on node 0), GRADSYNC_NODE naming the
# node and GRADSYNC_GLOO_HOST its address; Gloo then meets and talks through the store as
# across machines. (MPI is not run here: mpirun starts its ranks through its own launcher, which
# cannot enter the namespaces.)
#
#   sudo scripts/simulate_nodes.sh [--nodes 2] [--ranks-per-node 2] [--rate 1gbit] [--delay 100us] \
#        [--measure-link] -- PROGRAM [ARGS...]
#   scripts/simulate_nodes.sh --check     exit 0 when it can run here; else 77, saying why
#   sudo scripts/simulate_nodes.sh --nodes N --driver -- PROGRAM [ARGS...]
#        the nodes only: PROGRAM runs once, here, with GRADSYNC_NETNS_PREFIX=P set, and starts what
#        it wants in them (`ip netns exec Pn<k> ...`; node k is 10.201.0.<k+1>) and may cut a node
#        off and join it again (`ip -n Psw link set Pb<k> down|up`); benchmarks/fault_tolerance.sh
#        --stop partition does.
#
# Traffic only ever goes to the namespaces' own addresses (10.201.0.0/24, which exists only
# inside them); the namespaces are deleted on exit, whatever happens.
# --measure-link first sends 64 MiB over TCP from node 1 to node 0 and prints the rate: the
# ceiling a collective's bus bandwidth is compared with.
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

nodes=2
per_node=2
rate=1gbit
delay=100us
check_only=false
measure=false
driver=false
while [[ $# -gt 0 ]]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) per_node=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --check) check_only=true; shift ;;
    --measure-link) measure=true; shift ;;
    --driver) driver=true; shift ;;
    --) shift; break ;;
    *) echo "simulate_nodes.sh: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

skip() { echo "simulate_nodes.sh: cannot simulate nodes here: $*" >&2; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "network namespaces need root"
command -v ip > /dev/null && command -v tc > /dev/null || skip "ip and tc (iproute2) are not installed"

prefix="gs$$"
switch="${prefix}sw"
cleanup() {
  for ((n = 0; n < nodes; ++n)); do ip netns del "${prefix}n$n" 2> /dev/null; done
  ip netns del "$switch" 2> /dev/null
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$switch" 2> /dev/null || skip "ip netns add failed (no CAP_SYS_ADMIN, or no namespace support)"
ip -n "$switch" link add br0 type bridge 2> /dev/null || skip "the kernel has no bridge support"
ip -n "$switch" link set br0 up

# Shapes what leaves `device` in namespace `ns`: a token bucket at the rate, and the delay
# in front of it where netem exists (it is a module that some kernels lack).
have_netem=unknown
shape() {
  local ns=$1 device=$2
  if [[ $have_netem != no ]] && ip netns exec "$ns" tc qdisc add dev "$device" root handle 1: netem delay "$delay" limit 100000 2> /dev/null; then
    have_netem=yes
    ip netns exec "$ns" tc qdisc add dev "$device" parent 1: handle 2: tbf rate "$rate" burst 256kb latency 50ms
  else
    have_netem=no
    ip netns exec "$ns" tc qdisc add dev "$device" root tbf rate "$rate" burst 256kb latency 50ms
  fi
}

for ((n = 0; n < nodes; ++n)); do
  ns="${prefix}n$n"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip link add "${prefix}a$n" netns "$ns" type veth peer name "${prefix}b$n" netns "$switch" 2> /dev/null ||
    skip "the kernel has no veth support"
  ip -n "$ns" addr add "10.201.0.$((n + 1))/24" dev "${prefix}a$n"
  ip -n "$ns" link set "${prefix}a$n" up
  ip -n "$switch" link set "${prefix}b$n" master br0
  ip -n "$switch" link set "${prefix}b$n" up
  shape "$ns" "${prefix}a$n" || skip "tc could not shape a link (no tbf qdisc)"
  shape "$switch" "${prefix}b$n" || skip "tc could not shape a link (no tbf qdisc)"
done
$check_only && exit 0

if [[ $have_netem == yes ]]; then
  echo "simulate_nodes.sh: $nodes nodes x $per_node ranks; links $rate, $delay each way per hop"
else
  echo "simulate_nodes.sh: $nodes nodes x $per_node ranks; links $rate (no delay: this kernel has no netem)"
fi

if $measure; then
  link=$(python3 - "$prefix" <<'EOF'
import socket, subprocess, sys, time
prefix = sys.argv[1]
# The listening socket must live in node 0: run the receiver there, the sender in node 1.
receiver = subprocess.Popen(["ip", "netns", "exec", prefix + "n0", sys.executable, "-c", """
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("10.201.0.1", 5201)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0; start = None
while True:
    d = c.recv(1 << 20)
    if not d: break
    if start is None: start = time.perf_counter()
    n += len(d)
print(n / (time.perf_counter() - start) / 1e6, flush=True)
"""], stdout=subprocess.PIPE, text=True)
receiver.stdout.readline()
subprocess.run(["ip", "netns", "exec", prefix + "n1", sys.executable, "-c", """
import socket
c = socket.create_connection(("10.201.0.1", 5201)); block = b"x" * (1 << 20)
for _ in range(64): c.sendall(block)
c.close()
"""], check=True)
print(f"{float(receiver.stdout.readline()):.1f}")
EOF
  )
  echo "simulate_nodes.sh: one TCP stream from node 1 to node 0: $link MB/s"
  export GRADSYNC_LINK_MBPS=$link
fi

[[ $# -gt 0 ]] || exit 0
if $driver; then
  GRADSYNC_NETNS_PREFIX=$prefix "$@"
  exit $?
fi
port=$((20000 + RANDOM % 20000))
token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
pids=()
for ((n = 0; n < nodes; ++n)); do
  ip netns exec "${prefix}n$n" env NNODES="$nodes" NODE_RANK="$n" MASTER_ADDR=10.201.0.1 MASTER_PORT="$port" \
    GRADSYNC_STORE_TOKEN="$token" GRADSYNC_GLOO_HOST="10.201.0.$((n + 1))" GRADSYNC_NODE="node$n" \
    "$root/scripts/launch.sh" "$per_node" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid"
  code=$?
  ((code != 0 && status == 0)) && status=$code
done
exit $status
