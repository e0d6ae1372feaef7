#!/usr/bin/env bash
# A two-node Ray cluster on one machine, each node in its own network namespace: a local rehearsal of
# pdserve across two hosts (prefill on one, decode on the other, the KV cache crossing a real link).
#
#   scripts/netns-cluster.sh up       create the namespaces and links, start the Ray head and worker
#   scripts/netns-cluster.sh down     stop every process in the namespaces, delete them and the links
#   scripts/netns-cluster.sh status   what exists and what runs
#   scripts/netns-cluster.sh env      the environment a client needs (RAY_ADDRESS, the auth token)
#
# Topology (root only; both commands are idempotent):
#
#   pdserve-a  "host A": pdserve-ab 10.77.0.1/24 ──veth── pdserve-ba 10.77.0.2/24  "host B"  pdserve-b
#              Ray head, resource pdserve_prefill            Ray worker, resource pdserve_decode
#              pdserve-ha 10.77.1.1/24 ──veth── pdserve-h 10.77.1.254/24 (this machine's own namespace:
#              the client; routes 10.77.0.0/24 via host A, which forwards to host B)
#
# Ray of this cluster lives under $PDSERVE_NETNS_DIR (default /tmp/pdserve-netns): per node a Ray temp
# dir, TMPDIR (so pdserve's per-host port/core locks are per node, as on two machines) and the engine
# logs (PDSERVE_LOG_DIR). Nothing is shared with a Ray started elsewhere on this machine. `down` ends only
# processes inside the two namespaces (never `ray stop`, which would stop every Ray on the machine).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
NS_A=pdserve-a
NS_B=pdserve-b
IF_AB=pdserve-ab IF_BA=pdserve-ba   # the link between the two hosts
IF_HA=pdserve-ha IF_H=pdserve-h     # the client link: host A <-> this machine
IP_A=10.77.0.1 IP_B=10.77.0.2 NET=10.77.0.0/24
IP_HA=10.77.1.1 IP_H=10.77.1.254 CLIENT_NET=10.77.1.0/24
RAY_PORT=6379
DIR="${PDSERVE_NETNS_DIR:-/tmp/pdserve-netns}"
RAY="${PDSERVE_RAY:-$ROOT/.venv/bin/ray}"
NUM_CPUS="${PDSERVE_NETNS_CPUS:-1}"

die() { echo "netns-cluster: $*" >&2; exit 1; }
say() { echo "netns-cluster: $*" >&2; }

preflight() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (it creates network namespaces and veth links)"
  command -v ip >/dev/null 2>&1 || die "'ip' not found: install iproute2 (apt-get install iproute2)"
}

# No `| grep -q` on a producer below: with pipefail, grep leaving early can fail the producer (SIGPIPE).
ns_exists() { [ -e "/run/netns/$1" ]; }
link_in() { ip -n "$1" link show "$2" >/dev/null 2>&1; }   # link_in NS IFACE
has_addr() {   # has_addr NS IFACE IP (NS "" = this machine's own namespace)
  local a
  a="$(ip ${1:+-n "$1"} -4 addr show dev "$2" 2>/dev/null)"
  [[ "$a" == *"inet $3/"* ]]
}

# Ray processes are the only thing this script starts in the namespaces; engines are their children.
ray_running_in() {
  local p
  for p in $(ip netns pids "$1" 2>/dev/null); do
    [[ "$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)" == *raylet/raylet* ]] && return 0
  done
  return 1
}

gcs_up() { ip netns exec "$NS_A" timeout 2 bash -c "exec 3<>/dev/tcp/$IP_A/$RAY_PORT" 2>/dev/null; }

# Token authentication, as on real hosts (Ray enables it on a head that finds a token): one token for
# this cluster, in its own file; every node and every client (`pdserve serve --address`) needs it.
TOKEN="$DIR/auth_token"
client_env() { echo "RAY_ADDRESS=$IP_A:$RAY_PORT RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN"; }

make_token() {
  mkdir -p "$DIR"
  [ -s "$TOKEN" ] && return 0
  (umask 077; od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$TOKEN")
}

# Environment of one node's Ray processes (and so of the engine replicas it hosts).
node_env() {
  local node="$1"
  mkdir -p "$DIR/$node/tmp" "$DIR/$node/logs"
  echo "TMPDIR=$DIR/$node/tmp PDSERVE_LOG_DIR=$DIR/$node/logs RAY_USAGE_STATS_ENABLED=0" \
    "HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN"
}

net_up() {
  for ns in "$NS_A" "$NS_B"; do
    ns_exists "$ns" || ip netns add "$ns"
    ip -n "$ns" link set lo up
  done
  if ! link_in "$NS_A" "$IF_AB"; then
    # A leftover half of the pair (e.g. after an interrupted run) would block re-creating it.
    ip link del "$IF_AB" 2>/dev/null || true
    ip link del "$IF_BA" 2>/dev/null || true
    ip -n "$NS_B" link del "$IF_BA" 2>/dev/null || true
    ip link add "$IF_AB" type veth peer name "$IF_BA"
    ip link set "$IF_AB" netns "$NS_A"
    ip link set "$IF_BA" netns "$NS_B"
  fi
  has_addr "$NS_A" "$IF_AB" "$IP_A" || ip -n "$NS_A" addr add "$IP_A/24" dev "$IF_AB"
  has_addr "$NS_B" "$IF_BA" "$IP_B" || ip -n "$NS_B" addr add "$IP_B/24" dev "$IF_BA"
  ip -n "$NS_A" link set "$IF_AB" up
  ip -n "$NS_B" link set "$IF_BA" up

  if ! link_in "$NS_A" "$IF_HA"; then
    ip link del "$IF_H" 2>/dev/null || true
    ip link add "$IF_H" type veth peer name "$IF_HA"
    ip link set "$IF_HA" netns "$NS_A"
  fi
  has_addr "$NS_A" "$IF_HA" "$IP_HA" || ip -n "$NS_A" addr add "$IP_HA/24" dev "$IF_HA"
  has_addr "" "$IF_H" "$IP_H" || ip addr add "$IP_H/24" dev "$IF_H"
  ip -n "$NS_A" link set "$IF_HA" up
  ip link set "$IF_H" up
  # This machine reaches both hosts through A; A forwards; B answers the client through A.
  ip route replace "$NET" via "$IP_HA" dev "$IF_H"
  ip -n "$NS_B" route replace "$CLIENT_NET" via "$IP_A" dev "$IF_BA"
  ip netns exec "$NS_A" sysctl -qw net.ipv4.ip_forward=1
}

ray_up() {
  [ -x "$RAY" ] || die "$RAY not found (run make setup, or set PDSERVE_RAY)"
  make_token
  if ! ray_running_in "$NS_A"; then
    rm -rf "$DIR/a/ray"
    say "starting the Ray head in $NS_A ($IP_A:$RAY_PORT, resource pdserve_prefill)"
    # shellcheck disable=SC2046
    ip netns exec "$NS_A" env -u RAY_ADDRESS $(node_env a) "$RAY" start --head \
      --node-ip-address "$IP_A" --port "$RAY_PORT" --num-cpus "$NUM_CPUS" --num-gpus 0 \
      --resources '{"pdserve_prefill": 1}' --object-store-memory 100000000 \
      --include-dashboard false --disable-usage-stats --temp-dir "$DIR/a/ray" \
      >"$DIR/a/ray-start.log" 2>&1 || { cat "$DIR/a/ray-start.log" >&2; die "the Ray head did not start"; }
  fi
  for _ in $(seq 60); do gcs_up && break; sleep 0.5; done
  gcs_up || die "the Ray head does not answer on $IP_A:$RAY_PORT (log: $DIR/a/ray-start.log)"
  if ! ray_running_in "$NS_B"; then
    rm -rf "$DIR/b/ray"
    say "starting the Ray worker in $NS_B ($IP_B, resource pdserve_decode)"
    # shellcheck disable=SC2046
    ip netns exec "$NS_B" env -u RAY_ADDRESS $(node_env b) "$RAY" start --address "$IP_A:$RAY_PORT" \
      --node-ip-address "$IP_B" --num-cpus "$NUM_CPUS" --num-gpus 0 \
      --resources '{"pdserve_decode": 1}' --object-store-memory 100000000 \
      --disable-usage-stats --temp-dir "$DIR/b/ray" \
      >"$DIR/b/ray-start.log" 2>&1 || { cat "$DIR/b/ray-start.log" >&2; die "the Ray worker did not start"; }
  fi
  say "up: Ray head $IP_A:$RAY_PORT ($NS_A), worker $IP_B ($NS_B)"
  say "clients on host A: ip netns exec $NS_A env $(client_env) .venv/bin/pdserve serve FILE"
}

# Stop every process whose network namespace is NS: TERM, then KILL what is left after a grace period.
stop_all_in() {
  local ns="$1" pids
  ns_exists "$ns" || return 0
  pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
  [ -n "${pids// }" ] || return 0
  say "stopping $(wc -w <<<"$pids") processes in $ns"
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 30); do
    [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && return 0
    sleep 0.5
  done
  pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
  # shellcheck disable=SC2086
  [ -n "${pids// }" ] && kill -KILL $pids 2>/dev/null || true
  for _ in $(seq 20); do
    [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && return 0
    sleep 0.25
  done
  say "warning: processes still in $ns: $(ip netns pids "$ns" | tr '\n' ' ')"
}

down() {
  # Decode's node first, so its engines stop before the head they report to.
  stop_all_in "$NS_B"
  stop_all_in "$NS_A"
  ip route del "$NET" via "$IP_HA" dev "$IF_H" 2>/dev/null || true
  ip link del "$IF_H" 2>/dev/null || true
  for ns in "$NS_B" "$NS_A"; do
    ns_exists "$ns" && ip netns del "$ns"   # deleting a namespace deletes its ends of the veth pairs
  done
  # Halves left in this namespace by an interrupted `up`.
  ip link del "$IF_AB" 2>/dev/null || true
  ip link del "$IF_BA" 2>/dev/null || true
  say "down"
}

status() {
  local rc=0
  for ns in "$NS_A" "$NS_B"; do
    if ns_exists "$ns"; then
      echo "$ns: $(ip -n "$ns" -4 -br addr | awk '$1 != "lo" {print $1, $3}' | tr '\n' ' ')"
      if ray_running_in "$ns"; then
        echo "  ray: running ($(ip netns pids "$ns" | wc -l) processes)"
      else
        echo "  ray: not running"; rc=1
      fi
    else
      echo "$ns: absent"; rc=1
    fi
  done
  if ns_exists "$NS_A"; then
    if gcs_up; then echo "ray head: $IP_A:$RAY_PORT answers"; else echo "ray head: $IP_A:$RAY_PORT down"; rc=1; fi
  fi
  return $rc
}

case "${1:-}" in
  up) preflight; net_up; ray_up ;;
  down) preflight; down ;;
  status) preflight; status ;;
  env) client_env ;;   # what a client of the cluster needs in its environment
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
