#!/usr/bin/env bash
# The harvesting scenario (tests/scenarios/harvest.toml) three ways, on
# the same one-core board, with the same two VMs and models, rounds
# interleaved:
#   harvest  as the file says: 1+1 vNPUs that borrow idle engines;
#   static   the same vNPUs, lending off (vnpu daemon --harvest off);
#   prema    whole-core vNPUs (4+4, oversubscribed 2x) time-sharing the
#            core request by request, lending off (PREMA-like).
# Prints, per way, min/median/max over the rounds of the board's
# simulated time until both VMs were done (both run every request of
# theirs, so less is more throughput), each VM's median simulated time per
# request, and the CNN's borrowed engine-microseconds.
#   bash scripts/harvest-compare.sh [ROUNDS] [VNPU_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
vnpu=${2:-target/release/vnpu}
[ -n "${2:-}" ] || cargo build --release -q -p vnpu-cli
bash scripts/harvest-models.sh "$vnpu" > /dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
src=tests/scenarios/harvest.toml
abs() { sed "s|\"\.\./|\"$PWD/tests/|; s|board = \"one-core-board.toml\"|board = \"$PWD/tests/scenarios/one-core-board.toml\"|" "$1"; }
abs "$src" > "$tmp/harvest.toml"
abs "$src" | sed 's|^board = |harvest = false\nboard = |' > "$tmp/static.toml"
abs "$src" | sed 's|^board = |harvest = false\noversubscribe = 2\nboard = |; s|vnpu = \["sa=1,vu=1,|vnpu = ["sa=4,vu=4,|' > "$tmp/prema.toml"
for r in $(seq "$rounds"); do
    for way in harvest static prema; do
        out=$("$vnpu" scenario "$tmp/$way.toml")
        board=$(echo "$out" | awk '$1 == "0" && NF >= 6 { print $4; exit }')
        cnn=$(echo "$out" | sed -n 's/^\[cnn\] latency.*simulated NPU time [0-9.]*\/\([0-9.]*\)\/.*/\1/p')
        vec=$(echo "$out" | sed -n 's/^\[vector\] latency.*simulated NPU time [0-9.]*\/\([0-9.]*\)\/.*/\1/p')
        borrowed=$(echo "$out" | sed -n 's/.*cnn\/vnpu-1 borrowed \([0-9.]*\),.*/\1/p')
        echo "$way $board $cnn $vec ${borrowed:-0}" >> "$tmp/results"
        echo "round $r $way: board ${board} us, cnn ${cnn} us/request, vector ${vec} us/request, cnn borrowed ${borrowed:-0} engine-us" >&2
    done
done
python3 - "$tmp/results" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
print(f"{'way':<8} {'board us min/median/max':>26} {'cnn us/request':>15} {'vector us/request':>18} {'cnn borrowed':>13}")
for way in ["harvest", "static", "prema"]:
    r = [list(map(float, x[1:])) for x in rows if x[0] == way]
    b = sorted(x[0] for x in r)
    med = lambda i: statistics.median(x[i] for x in r)
    print(f"{way:<8} {b[0]:>8.1f}/{statistics.median(b):>8.1f}/{b[-1]:>8.1f} {med(1):>15.2f} {med(2):>18.2f} {med(3):>13.1f}")
PY
