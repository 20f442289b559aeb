#!/bin/sh
# Hybrid sharding across two hosts, as users run it: two "hosts" made of network namespaces on
# this machine (each its own network stack and hostname, one veth pair each into a third
# namespace holding a bridge with its own address), `mpirun` started on host A reaching host
# B's daemon through a plm_rsh_agent script that runs its command under `ip netns exec`, two
# ranks per host. strategy = "hybrid" with shard_size 2 shards inside a host (shared memory)
# and replicates across the hosts (TCP over the veth pair):
#   - a small GPT trained 50 steps equals the 1-rank unwrapped run (tests/dist/compare.lua) and
#     gives the very same bits as the local backend at 4 ranks;
#   - host B's interface received at least what the replicate all-reduces move into it (2 ranks
#     x 50 steps x the shard bytes tests/dist/hybrid.lua reports) and less than 1.5 times that:
#     the sharding traffic (several times larger) stayed inside each host;
#   - tests/dist/hybrid.lua (bytes per group, refusals, checkpoints across strategies) passes.
# Open MPI 4.1 needs --mca routed direct, --mca rtc ^hwloc, PMIX_MCA_gds=hash and the interfaces
# held to the bridge's subnet (docs/mpi.md, "Two hosts on one machine"). The namespaces are made
# here and removed on any exit. Skips (77) without mpirun, an mpi build, unshare, or the right to
# create network namespaces (`ip netns add` fails: not root, or a container without the
# capability).
. "${0%/*}/lib.sh"
need_mpi
need ip "apt-get install iproute2"
need unshare "apt-get install util-linux"
trap 'exit 143' INT TERM HUP # the EXIT trap (lib.sh: AT_EXIT, then $T) runs on signals too
P=fsdp$$
A=${P}a B=${P}b BR=${P}br
# remove what was made, processes left in the namespaces first (ours: started below)
AT_EXIT='for ns in $A $B $BR; do for pid in $(ip netns pids $ns 2>/dev/null); do kill -9 $pid 2>/dev/null; done; ip netns del $ns 2>/dev/null; done'
ip netns add "$A" 2>"$T/netns" || skip "cannot create a network namespace (ip netns add: $(cat "$T/netns"))"
must "ip netns add" ip netns add "$B"
must "ip netns add" ip netns add "$BR"
net() { must "ip $*" ip "$@"; }
net -n "$BR" link add br0 type bridge
net -n "$BR" addr add 10.77.0.254/24 dev br0
net -n "$BR" link set br0 up
i=1
for ns in $A $B; do
  net -n "$ns" link set lo up
  net -n "$ns" link add eth0 type veth peer name port$i netns "$BR"
  net -n "$ns" addr add 10.77.0.$i/24 dev eth0
  net -n "$ns" link set eth0 up
  net -n "$BR" link set port$i master br0
  net -n "$BR" link set port$i up
  i=$((i + 1))
done
# the rsh agent: `agent HOST COMMAND...` runs COMMAND on that host: in its namespace, with its
# own hostname (Open MPI names shared-memory segments after the host)
cat >"$T/agent" <<AGENT
#!/bin/sh
host=\$1
shift
case \$host in
  10.77.0.1) ns=$A ;;
  10.77.0.2) ns=$B ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec \$ns unshare --uts sh -c "hostname host-\$ns; \$*"
AGENT
chmod +x "$T/agent"
# on_hosts OUT ARGS...: fsdprun ARGS on 2 x 2 ranks, mpirun on host A; output in OUT
on_hosts() {
  oh_out=$1
  shift
  timeout -k 5 40 ip netns exec "$A" unshare --uts sh -c "hostname host-$A; exec mpirun \
    --allow-run-as-root --oversubscribe --host 10.77.0.1:2,10.77.0.2:2 -np 4 \
    --mca plm_rsh_agent $T/agent --mca routed direct --mca rtc ^hwloc -x PMIX_MCA_gds=hash \
    --mca btl self,vader,tcp --mca btl_tcp_if_include 10.77.0.0/24 \
    --mca oob_tcp_if_include 10.77.0.0/24 --mca btl_base_warn_component_unused 0 \
    $FSDPRUN $*" >"$oh_out" 2>&1 &
  wait $! # (in the background: a signal runs the clean-up at once, not after mpirun ends)
}
rx_b() { ip netns exec "$B" cat /sys/class/net/eth0/statistics/rx_bytes; }
# where each rank runs
on_hosts "$T/where" -e "'io.write(require(\"fsdp\").rank(), \" \", io.popen(\"hostname\"):read(), \"\\n\")'" ||
  { cat "$T/where"; die "mpirun across the two namespaces failed"; }
for r in 0 1; do grep -qx "$r host-$A" "$T/where" || fail "rank $r is not on host A: $(cat "$T/where")"; done
for r in 2 3; do grep -qx "$r host-$B" "$T/where" || fail "rank $r is not on host B: $(cat "$T/where")"; done
# bytes per group, refusals, checkpoints; its replicate bytes per step for the bound below
mkdir -p "$T/ck"
on_hosts "$T/log" "$SRC/tests/dist/hybrid.lua" --dir="$T/ck" || die_log "tests/dist/hybrid.lua on two hosts"
cat "$T/log"
rar=$(sed -n 's/.*replicate group all_reduce \([0-9]*\) B.*/\1/p' "$T/log")
[ -n "$rar" ] || die "tests/dist/hybrid.lua did not report the replicate bytes"
# training equals one rank, and the local backend bit for bit
train_equiv 1 "$T/ref" --model=gpt --strategy=plain
train_equiv 4 "$T/local" --model=gpt --strategy=hybrid --shard_size=2
rx0=$(rx_b)
on_hosts "$T/log" "$SRC/tests/dist/train_equiv.lua" --model=gpt --strategy=hybrid --shard_size=2 \
  --out="$T/hosts" || die_log "train_equiv on two hosts"
rx1=$(rx_b)
compare "$T/ref" "$T/hosts" "gpt hybrid on two hosts x 2 ranks vs 1 rank unwrapped"
compare "$T/local" "$T/hosts" "gpt hybrid on two hosts = local -n 4" --exact
got=$((rx1 - rx0)) low=$((2 * 50 * rar))
if [ "$got" -lt "$low" ] || [ "$got" -gt $((low * 3 / 2)) ]; then
  fail "host B received $got bytes over TCP, expected $low (the replicate all-reduces) to $((low * 3 / 2))"
else
  echo "ok: host B received $got bytes over TCP for $low bytes of replicate all-reduces"
fi
finish
