#!/usr/bin/env bash
# Coverage-guided fuzzing of every decoder of untrusted input (the fuzz_test
# targets of tests/fuzz) with libFuzzer, AddressSanitizer and
# UndefinedBehaviorSanitizer, built by clang-14 (--config=fuzz) in an output
# base of its own so that the g++ build's cache is never invalidated.
#
#   tools/fuzz.sh                 at least 1,000,000 inputs per target
#   tools/fuzz.sh --ci            a short bounded run per target (CI)
#   tools/fuzz.sh [--ci] NAME...  only these targets (e.g. tcp_wire_fuzzer)
#
# Environment: FUZZ_RUNS (default 1000000), FUZZ_CI_SECONDS (default 12),
# FUZZ_OUTPUT_BASE (default /tmp/rdma-agentd-fuzz), FUZZ_WORK_DIR (where
# corpora grown by libFuzzer, logs and crashing inputs go; default a new temp
# dir), FUZZ_RESULTS (a file that gets one "NAME PASS|FAIL" line per target,
# for tools/test.sh).
#
# Prints one result line per target: inputs run, seconds, inputs per second;
# a crash prints the input libFuzzer saved and the end of its report. Exits
# non-zero if the build or any target failed. Seeds in tests/fuzz/corpus are
# only read; to keep a crashing input, copy it there as crash-<what>.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=full
names=()
for arg in "$@"; do
  case "$arg" in
    --ci) mode=ci ;;
    -h | --help)
      sed -n '2,21p' "$0"
      exit 0
      ;;
    -*)
      echo "fuzz.sh: unknown option $arg" >&2
      exit 2
      ;;
    *) names+=("$arg") ;;
  esac
done

runs=${FUZZ_RUNS:-1000000}
ci_seconds=${FUZZ_CI_SECONDS:-12}
output_base=${FUZZ_OUTPUT_BASE:-/tmp/rdma-agentd-fuzz}
work=${FUZZ_WORK_DIR:-}
keep_work=${work:+1}
[[ -n $work ]] || work=$(mktemp -d /tmp/rdma-agentd-fuzz-run.XXXXXX)
results=${FUZZ_RESULTS:-/dev/null}
mkdir -p "$work"
# Its own server; it exits soon after so that CI machines do not keep two.
bazel=(bazel --output_base="$output_base" --max_idle_secs=120)

if ! command -v clang-14 >/dev/null; then
  echo "fuzz.sh: clang-14 is missing (tools/install-deps.sh installs it)" >&2
  exit 1
fi

if ((${#names[@]} == 0)); then
  mapfile -t names < <("${bazel[@]}" query --noshow_progress \
    'attr(tags, "\bfuzz_target\b", //tests/fuzz:all)' 2>/dev/null |
    sed 's|^//tests/fuzz:||')
fi
if ((${#names[@]} == 0)); then
  echo "fuzz.sh: no fuzz targets found" >&2
  exit 1
fi

build_start=$SECONDS
if ! "${bazel[@]}" build --config=fuzz --noshow_progress \
  "${names[@]/#///tests/fuzz:}" >"$work/build.log" 2>&1; then
  tail -n 40 "$work/build.log" >&2
  echo "fuzz: build failed (log: $work/build.log)"
  for name in "${names[@]}"; do echo "$name FAIL" >>"$results"; done
  exit 1
fi
echo "fuzz: built ${#names[@]} targets with clang-14 in $((SECONDS - build_start)) s"
bin=$("${bazel[@]}" info --config=fuzz bazel-bin 2>/dev/null)

if [[ $mode == ci ]]; then
  budget=(-max_total_time="$ci_seconds")
else
  budget=(-runs="$runs")
fi

failed=0
for name in "${names[@]}"; do
  dir="$work/$name"
  mkdir -p "$dir/corpus"
  start=$(date +%s%N)
  # The first directory is where libFuzzer adds what it finds; the seeds are
  # only read.
  ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=0:detect_leaks=1} \
    UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    "$bin/tests/fuzz/$name" "${budget[@]}" -timeout=30 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$dir/" \
    "$dir/corpus" "tests/fuzz/corpus/$name" >"$dir/log" 2>&1
  status=$?
  elapsed_ms=$((($(date +%s%N) - start) / 1000000))
  seconds=$((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000)) | cut -c1)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$dir/log" | tail -1)
  if [[ $status -eq 0 ]]; then
    printf 'fuzz: %-24s PASS %10s inputs in %6s s (%s/s), 0 crashes\n' \
      "$name" "${execs:-?}" "$seconds" "${rate:-?}"
    echo "$name PASS" >>"$results"
  else
    failed=1
    artifact=$(ls "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-* \
      2>/dev/null | head -1)
    printf 'fuzz: %-24s FAIL after %s inputs in %s s: %s\n' \
      "$name" "${execs:-?}" "$seconds" "${artifact:-no input saved}"
    grep -m1 -A25 -E 'ERROR: (Address|Undefined|Leak|libFuzzer)|runtime error|FUZZ_CHECK failed' \
      "$dir/log" | sed 's/^/    /'
    echo "    (full log: $dir/log)"
    echo "$name FAIL" >>"$results"
  fi
done
# A passing CI run leaves nothing behind; failures keep their inputs and logs.
if [[ $mode == ci && $failed -eq 0 && -z $keep_work ]]; then
  rm -rf "$work"
fi
exit $failed
