# Sourced by the demo scripts: dbufd on a socket in a fresh temp directory.
#   start_temp_dbufd BUILD_DIR [LOG_LEVEL]   sets $workdir, $socket, $daemon_pid
#   stop_temp_dbufd                          SIGTERM and wait; its exit status
# An EXIT trap stops the daemon (if still running) and removes $workdir.
workdir=$(mktemp -d)
socket="$workdir/dbufd.sock"
daemon_pid=
cleanup_temp_dbufd() {
  if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then kill -TERM "$daemon_pid"; wait "$daemon_pid" || true; fi
  rm -rf "$workdir"
}
trap cleanup_temp_dbufd EXIT

start_temp_dbufd() {
  "$1/bin/dbufd" --config config/dbufd.toml --socket "$socket" --log-level "${2:-info}" 2>"$workdir/dbufd.log" &
  daemon_pid=$!
  for _ in $(seq 100); do [[ -S "$socket" ]] && break; sleep 0.05; done
  [[ -S "$socket" ]] || { echo "dbufd did not start:"; cat "$workdir/dbufd.log"; exit 1; }
}

stop_temp_dbufd() {
  local status=0
  kill -TERM "$daemon_pid"
  wait "$daemon_pid" || status=$?
  daemon_pid=
  return $status
}
