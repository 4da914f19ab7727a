# Call 6 (2x H200): the shipped 2-GPU policy (call 5's, now in models/) through the held-out dispatch evaluation.
set -uo pipefail
rm -rf /tmp/ship-w2
TAIL=20 bash scripts/gpu_ship.sh 2 0,1 shipped,eval
