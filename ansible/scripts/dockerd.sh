#!/usr/bin/env bash
# A Docker engine for the container runtime on a machine without one running (CI, a fresh box): starts
# Debian's dockerd when no daemon answers, and stops only a daemon it started. Its networking is left
# alone: no iptables rules and no default bridge (dockerd's defaults set the FORWARD policy to DROP, which
# cuts the namespace test hosts' bridge); kvscope's containers and builds use the host network.
# Needs root and the docker.io package (make test-deps).
#   ansible/scripts/dockerd.sh start | stop
set -euo pipefail
state=/var/lib/kvscope/dockerd
case "${1:-}" in
start)
  docker version --format '{{.Server.Version}}' >/dev/null 2>&1 && { echo "dockerd: a daemon already runs"; exit 0; }
  install -d -m 0700 "$state"
  setsid dockerd --iptables=false --ip6tables=false --bridge=none --pidfile "$state/dockerd.pid" \
    > "$state/dockerd.log" 2>&1 < /dev/null &
  for _ in $(seq 60); do
    docker version --format '{{.Server.Version}}' >/dev/null 2>&1 && { echo "dockerd: started (log $state/dockerd.log)"; exit 0; }
    sleep 1
  done
  echo "dockerd: did not come up in 60 s; last log lines:" >&2; tail -n 20 "$state/dockerd.log" >&2; exit 1
  ;;
stop)
  [ -f "$state/dockerd.pid" ] || { echo "dockerd: none started here"; exit 0; }
  pid=$(cat "$state/dockerd.pid")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  rm -f "$state/dockerd.pid"
  echo "dockerd: stopped"
  ;;
*) echo "usage: $0 start | stop" >&2; exit 2 ;;
esac
