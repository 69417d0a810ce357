#!/usr/bin/env bash
# One GPU session in one command: verify, a short profile of the hot paths,
# and the benchmark record, every output under $OUT, within a wall-clock cap.
#
#   . /tmp/kvgpu/env && OUT=/some/dir bash tools/gpu_session.sh [all|verify|bench]
#
# all (the default) fits in $SESSION_CAP seconds (570): verify gets at most
# $VERIFY_CAP (300) of it and is stopped with SIGINT when it runs over (it then
# prints the checks finished so far and names the jobs that did not run),
# the profile ~40 s, the bench whatever is left. `verify` alone gives verify
# 540 s; `bench` alone gives the bench the whole cap.
#
# TINY=1 runs every step at toy sizes on the CPU (--device cpu): the check
# that this script cannot fail for a silly reason before it meets a GPU.
#
# The record's PNG needs matplotlib, which the GPU machine lacks: the bench
# writes the JSON and Markdown there and says so; draw the plot later on the
# CPU with `kvspec bench --plot $OUT/bench/<date>-gpu.json`.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-session-out}
PHASE=${1:-all}
SESSION_CAP=${SESSION_CAP:-570}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( SESSION_CAP - ($(date +%s) - start) )); }
say() { echo "[gpu_session $(( $(date +%s) - start ))s] $*" | tee -a "$OUT/session.log"; }

if [ "${TINY:-0}" = 1 ]; then
  DEVICE=cpu
  VERIFY_ARGS=(--quick -k "equivalent" -k "bug gpu_*" -k "trace dense*" -j 2)
  PROFILE_ARGS=(--contexts 64 128 --layers 2 --rounds 2)
  BENCH_ARGS=(--contexts 64 128 --layers 2 --rounds 2 --e2e-contexts 32 64 --tokens 4 --repeats 6 --e2e-size tiny)
  VERIFY_CAP=${VERIFY_CAP:-120}
else
  DEVICE=gpu
  VERIFY_ARGS=(-j "${JOBS:-14}")
  PROFILE_ARGS=(--contexts 1024 32768 --layers 28 --rounds 10)
  BENCH_ARGS=(--contexts 1024 8192 32768 --tokens "${TOKENS:-16}" --repeats "${REPEATS:-24}")
  VERIFY_CAP=${VERIFY_CAP:-300}
fi
[ "$PHASE" = verify ] && VERIFY_CAP=$(( SESSION_CAP - 30 ))
# VERIFY_K="pattern;pattern..." runs only the verify jobs matching one of
# them (kvspec verify -k, each a shell glob such as "fuzz dense*"; not
# expanded here); E2E=0 leaves the end-to-end rows out of the bench (they
# need the most time and are the noisiest)
# REPEATS=N: measured end-to-end blocks per config and context (24), TOKENS=N
# tokens a block (16): the configs decode their blocks in turn from caches
# kept alive, each block paired with mlx-lm's of the same round
IFS=';' read -ra KPATS <<< "${VERIFY_K:-}"
for pat in "${KPATS[@]}"; do [ -n "$pat" ] && VERIFY_ARGS+=(-k "$pat"); done
E2E_FLAG=--e2e
[ "${E2E:-1}" = 0 ] && E2E_FLAG=
# DECODER=0 leaves the decoder rows out (an end-to-end-only bench)
DECODER_FLAG=--decoder
[ "${DECODER:-1}" = 0 ] && DECODER_FLAG=

say "phase $PHASE, device $DEVICE, output $OUT, cap ${SESSION_CAP}s"
$PY -c "import mlx.core as mx, sys; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available(), sys.version.split()[0])" 2>&1 | tee -a "$OUT/session.log"

status=0
if [ "$PHASE" = all ] || [ "$PHASE" = verify ]; then
  cap=$(( VERIFY_CAP < $(left) - 20 ? VERIFY_CAP : $(left) - 20 ))
  say "verify (cap ${cap}s): $PY -m kvspec.fuzz.commands.cli verify --device $DEVICE ${VERIFY_ARGS[*]}"
  COLUMNS=200 timeout -s INT -k 30 "$cap" $PY -m kvspec.fuzz.commands.cli verify --device "$DEVICE" "${VERIFY_ARGS[@]}" \
    --junit-xml "$OUT/verify-junit.xml" > "$OUT/verify.txt" 2> "$OUT/verify.log"
  rc=$?
  # the kvtraces of failed checks (the table names them) come back as one archive:
  # a device call returns a limited number of files, and the mutation jobs leave
  # hundreds there (copied as files, they crowded out the bench record)
  [ -d fuzz-failures ] && tar czf "$OUT/fuzz-failures.tar.gz" fuzz-failures 2>/dev/null
  say "verify exit $rc (0 all passed, 1 a check failed, 130/124 stopped at the cap)"
  tail -n 40 "$OUT/verify.txt" | tee -a "$OUT/session.log"
  [ $rc = 0 ] || status=1
fi

if [ "$PHASE" = all ]; then
  cap=$(( 60 < $(left) - 10 ? 60 : $(left) - 10 ))
  if [ "$cap" -gt 5 ]; then
    say "profile of the hot paths (cap ${cap}s)"
    timeout -k 10 "$cap" $PY tools/gpu_profile.py --device "$DEVICE" "${PROFILE_ARGS[@]}" \
      --out "$OUT/profile.json" > /dev/null 2> "$OUT/profile.log"
    say "profile exit $?"
    tail -n 20 "$OUT/profile.log" | tee -a "$OUT/session.log"
  fi
fi

if [ "$PHASE" = all ] || [ "$PHASE" = bench ]; then
  cap=$(( $(left) - 5 ))
  if [ "$cap" -gt 10 ]; then
    say "bench $DECODER_FLAG $E2E_FLAG (cap ${cap}s)"
    COLUMNS=200 timeout -s INT -k 10 "$cap" $PY -m kvspec.fuzz.commands.cli bench --device "$DEVICE" $DECODER_FLAG $E2E_FLAG \
      "${BENCH_ARGS[@]}" --record "$OUT/bench" > "$OUT/bench.txt" 2> "$OUT/bench.log"
    rc=$?
    say "bench exit $rc"
    tail -n 60 "$OUT/bench.txt" | tee -a "$OUT/session.log"
    [ $rc = 0 ] || status=1
  else
    say "bench not run: no time left"
    status=1
  fi
fi
say "done, exit $status; files: $(cd "$OUT" && ls | tr '\n' ' ')"
# a device call brings back only a few files (8 on 2026-12-01: the bench
# record, third in the listing, was left out): everything but the log goes
# back as one archive (unpack: tar xzf session.tar.gz)
( cd "$OUT" && tar czf ../kvgpu-session.tar.gz --exclude session.log . && \
  find . -mindepth 1 -maxdepth 1 ! -name session.log -exec rm -rf {} + && mv ../kvgpu-session.tar.gz session.tar.gz )
exit $status
