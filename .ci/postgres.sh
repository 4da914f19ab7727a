#!/usr/bin/env bash
# A throwaway PostgreSQL server on loopback for the multi-worker tuning test (tests/test_tune.py).
# Installs the server from Debian packages if it is missing (root + apt), starts one cluster of its own
# (data in $AUTOFUSE_PG_DIR, default /tmp/autofuse-pg; port $AUTOFUSE_PG_PORT, default 15432; trust
# authentication, listening on 127.0.0.1 only) and creates the database autofuse_test.
# Idempotent: a server already answering on the port is reused. Prints only the URL to export as
# AUTOFUSE_TEST_PG_URL on stdout; progress goes to stderr. AUTOFUSE_PG_NO_INSTALL=1: never apt-get.
# AUTOFUSE_PG_STATE_FILE=path: writes "started" or "reused" there, so the caller knows whether to stop it.
# `postgres.sh stop` stops the server of $AUTOFUSE_PG_DIR (and, with AUTOFUSE_PG_REMOVE=1, deletes the folder).
set -euo pipefail
PORT=${AUTOFUSE_PG_PORT:-15432}  # below the ephemeral range: no client socket holds it
DIR=${AUTOFUSE_PG_DIR:-/tmp/autofuse-pg}
DB=autofuse_test
log() { echo "postgres.sh: $*" >&2; }
server_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
state() { [ -z "${AUTOFUSE_PG_STATE_FILE:-}" ] || echo "$1" > "$AUTOFUSE_PG_STATE_FILE"; }

if [ "${1:-}" = stop ]; then
  BIN=$(server_bin)
  if [ -n "$BIN" ] && [ -s "$DIR/data/postmaster.pid" ]; then
    log "stopping PostgreSQL of $DIR"
    if [ "$(id -u)" = 0 ]; then
      runuser -u postgres -- "$BIN/pg_ctl" -D "$DIR/data" -m fast -w -t 60 stop >&2 || true
    else
      "$BIN/pg_ctl" -D "$DIR/data" -m fast -w -t 60 stop >&2 || true
    fi
  fi
  [ -z "${AUTOFUSE_PG_REMOVE:-}" ] || rm -rf "$DIR"
  exit 0
fi

BIN=$(server_bin)
if [ -z "$BIN" ] || [ ! -x "$BIN/initdb" ] || [ ! -x "$BIN/postgres" ]; then
  [ -z "${AUTOFUSE_PG_NO_INSTALL:-}" ] || { log "no PostgreSQL server installed"; exit 1; }
  [ "$(id -u)" = 0 ] || { log "not root: cannot install postgresql with apt-get"; exit 1; }
  log "installing postgresql from Debian packages"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends postgresql >&2; then
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends postgresql >&2
  fi
  BIN=$(server_bin)
  [ -n "$BIN" ] && [ -x "$BIN/initdb" ] || { log "postgresql installed but initdb not found"; exit 1; }
fi

if [ "$(id -u)" = 0 ]; then
  OWNER=postgres
  as_owner() { runuser -u postgres -- "$@"; }
else
  OWNER=$(id -un)
  as_owner() { "$@"; }
fi
URL="postgresql://$OWNER@127.0.0.1:$PORT/$DB"
PSQL=("$BIN/psql" -h 127.0.0.1 -p "$PORT" -U "$OWNER" -v ON_ERROR_STOP=1 -qtA)

state reused
if ! "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT"; then
  state started
  mkdir -p "$DIR"
  [ "$(id -u)" != 0 ] || chown "$OWNER" "$DIR"
  if [ ! -s "$DIR/data/PG_VERSION" ]; then
    log "initdb $DIR/data"
    as_owner "$BIN/initdb" -D "$DIR/data" -U "$OWNER" --auth=trust -E UTF8 >&2
  fi
  log "starting PostgreSQL on 127.0.0.1:$PORT"
  as_owner "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $PORT -k $DIR -c fsync=off -c max_connections=100" start >&2 \
    || { tail -n 20 "$DIR/server.log" >&2 || true; exit 1; }
fi

if [ "$("${PSQL[@]}" -d postgres -c "SELECT 1 FROM pg_database WHERE datname = '$DB'")" != 1 ]; then
  "${PSQL[@]}" -d postgres -c "CREATE DATABASE $DB" >&2
fi
"${PSQL[@]}" -d "$DB" -c "SELECT 1" >/dev/null
echo "$URL"
