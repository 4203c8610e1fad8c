#!/bin/bash
# usage: cgone.sh PYTHONPATH mode label -> per-iteration instructions per group for that mode
PY=$(python -c "import sys; print(sys.executable)")
run() { PYTHONPATH=$1 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.$3.$2.$4 $PY bench/results/2026-11-23-cpu/ablate_instructions.py $2 $4 >/dev/null 2>&1; grep totals /tmp/cg.$3.$2.$4 | awk '{print $2}'; }
a=$(run $1 $2 $3 1); b=$(run $1 $2 $3 3)
echo "$3 $2 $(( (b - a) / 2 / 200 )) instr/group (incl. plain)"
