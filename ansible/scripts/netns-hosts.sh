#!/usr/bin/env bash
# Test hosts on this one machine: network namespaces kvh1..kvhN on a bridge (10.77.0.0/24, this machine is
# 10.77.0.1), each running its own sshd. They share the filesystem, so the repository, venvs and model are
# where Ansible expects them; traffic stays on these addresses and loopback. Needs root and openssh-server.
# Keys, sshd state and known_hosts live root-owned (0700) in /var/lib/kvscope/netns, outside the work tree;
# sshd checks their modes (StrictModes) and clients check the host key.
#   ansible/scripts/netns-hosts.sh up [N=3] | down
set -euo pipefail
state=/var/lib/kvscope/netns
n=${2:-3}
case "${1:-}" in
up)
  install -d -m 0755 -o root -g root /var/lib/kvscope
  install -d -m 0700 -o root -g root "$state"
  [ -f "$state/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -f "$state/id_ed25519"
  [ -f "$state/host_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -f "$state/host_ed25519"
  : > "$state/known_hosts"
  ip link show kvbr0 >/dev/null 2>&1 || { ip link add kvbr0 type bridge; ip addr add 10.77.0.1/24 dev kvbr0; }
  ip link set kvbr0 up
  mkdir -p /run/sshd
  for i in $(seq 1 "$n"); do
    h=kvh$i; addr=10.77.0.$((10 + i))
    # a host half made (its namespace without eth0) or half removed (the veth outliving a namespace whose last
    # process is still exiting) is made again
    if ip netns list | grep -qw "$h" && ! ip -n "$h" link show eth0 >/dev/null 2>&1; then ip netns del "$h"; fi
    if ! ip netns list | grep -qw "$h"; then
      for _ in $(seq 50); do ip link show "v$h" >/dev/null 2>&1 || break; sleep 0.2; done
      ip link del "v$h" 2>/dev/null || true
      ip netns add "$h"
      ip link add "v$h" type veth peer name eth0 netns "$h"
      ip link set "v$h" master kvbr0 up
      ip -n "$h" addr add "$addr/24" dev eth0
      ip -n "$h" link set eth0 up
      ip -n "$h" link set lo up
    fi
    cat > "$state/sshd_$h.conf" <<CONF
ListenAddress $addr
HostKey $state/host_ed25519
AuthorizedKeysFile $state/id_ed25519.pub
PidFile $state/sshd_$h.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
UsePAM no
Subsystem sftp /usr/lib/openssh/sftp-server
CONF
    [ -f "$state/sshd_$h.pid" ] && kill "$(cat "$state/sshd_$h.pid")" 2>/dev/null && sleep 0.5  # take the new config
    ip netns exec "$h" /usr/sbin/sshd -f "$state/sshd_$h.conf"
    echo "$h,$addr $(cut -d' ' -f1,2 "$state/host_ed25519.pub")" >> "$state/known_hosts"
    echo "$h $addr up"
  done
  for i in $(seq 1 "$n"); do  # for `ssh -F`: how the bench starts Locust workers on these hosts
    printf 'Host kvh%s\n  HostName 10.77.0.%s\n  User root\n  IdentityFile %s\n  StrictHostKeyChecking yes\n  UserKnownHostsFile %s\n  LogLevel ERROR\n' \
      "$i" "$((10 + i))" "$state/id_ed25519" "$state/known_hosts"
  done > "$state/config" ;;
down)
  for pid in "$state"/sshd_*.pid; do [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null; rm -f "$pid"; done
  for h in $(ip netns list | awk '/^kvh[0-9]+/ {print $1}'); do
    ip netns pids "$h" | xargs -r kill
    for _ in $(seq 100); do [ -z "$(ip netns pids "$h")" ] && break; sleep 0.2; done  # what runs there exits first
    ip netns pids "$h" | xargs -r kill -9
    ip netns del "$h"
  done
  for v in $(ip -o link show | awk -F'[ :@]+' '$2 ~ /^vkvh[0-9]+$/ {print $2}'); do
    for _ in $(seq 50); do ip link show "$v" >/dev/null 2>&1 || break; sleep 0.2; done  # the namespace is gone
  done
  ip link del kvbr0 2>/dev/null || true
  echo down ;;
*) echo "usage: $0 up [N] | down" >&2; exit 2 ;;
esac
