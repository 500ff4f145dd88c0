#!/usr/bin/env bash
# Make sure a Redis answers on 127.0.0.1:6379: start redis-server if it is installed but not
# running, install it with apt-get if it is absent. Used by `make test`.
set -euo pipefail
HOST=127.0.0.1
PORT=${REDIS_PORT:-6379}

ping() {
  if command -v redis-cli >/dev/null 2>&1; then
    redis-cli -h "$HOST" -p "$PORT" ping 2>/dev/null | grep -q PONG
  else
    (exec 3<>/dev/tcp/$HOST/$PORT && printf 'PING\r\n' >&3 && head -c 5 <&3 | grep -q PONG) 2>/dev/null
  fi
}

ping && exit 0
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server not found: installing it with apt-get" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
echo "starting redis-server on $HOST:$PORT" >&2
mkdir -p /tmp/prefixlb-redis
redis-server --daemonize yes --bind "$HOST" --port "$PORT" --save "" --appendonly no \
  --dir /tmp/prefixlb-redis --logfile /tmp/prefixlb-redis/redis.log
for _ in $(seq 1 50); do ping && exit 0; sleep 0.1; done
echo "redis did not answer on $HOST:$PORT" >&2
exit 1
