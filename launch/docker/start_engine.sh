#!/usr/bin/env bash
# Start a Docker engine by hand (no systemd needed) for the docker sandbox, or reuse the one already answering.
# Installs docker.io (and debootstrap, which build_image.sh needs) with apt when they are missing. The engine
# gets no bridge and no iptables rules (sandboxes run with --network none) and a socket and data root of its own:
#
#   launch/docker/start_engine.sh && export DOCKER_HOST=unix:///run/agentic-rl/docker.sock
#
# Environment: AGENTIC_RL_DOCKER_SOCK (default /run/agentic-rl/docker.sock), AGENTIC_RL_DOCKER_DATA (default
# /var/lib/agentic-rl-docker). Needs root. The engine's pid is in $(dirname SOCK)/dockerd.pid, its log next to it.
set -euo pipefail

SOCK=${AGENTIC_RL_DOCKER_SOCK:-/run/agentic-rl/docker.sock}
DATA=${AGENTIC_RL_DOCKER_DATA:-/var/lib/agentic-rl-docker}
RUN=$(dirname "$SOCK")
export DOCKER_HOST=unix://$SOCK

if command -v docker >/dev/null && docker version >/dev/null 2>&1; then
  echo "start_engine.sh: an engine already answers at $DOCKER_HOST"
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "start_engine.sh: needs root" >&2; exit 2; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || { echo "start_engine.sh: no apt-get to install ${missing[*]}" >&2; exit 2; }
  echo "start_engine.sh: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$RUN" "$DATA"
rm -f "$SOCK"
setsid dockerd --bridge=none --iptables=false --ip6tables=false --data-root "$DATA" --exec-root "$RUN/exec" \
  --pidfile "$RUN/dockerd.pid" --host "unix://$SOCK" >"$RUN/dockerd.log" 2>&1 </dev/null &
for _ in $(seq 1 150); do
  if docker version >/dev/null 2>&1; then
    echo "start_engine.sh: engine $(docker version -f '{{.Server.Version}}') at $DOCKER_HOST (pid $(cat "$RUN/dockerd.pid"))"
    exit 0
  fi
  kill -0 $! 2>/dev/null || break
  sleep 0.2
done
echo "start_engine.sh: dockerd did not come up; its log ($RUN/dockerd.log):" >&2
tail -20 "$RUN/dockerd.log" >&2
exit 1
