#!/usr/bin/env bash
# Installs what is missing and runs the whole test suite with Bazel, then a
# short coverage-guided fuzzing run of every decoder of untrusted input
# (tools/fuzz.sh --ci: clang, libFuzzer, ASan, UBSan; RDMA_AGENTD_FUZZ=0
# skips it), checks formatting (tools/check_format.sh), checks that no
# testonly target reaches the binaries, and
# prints "N passed, N failed" counted from the test cases in
# Bazel's XML results plus one case per fuzz target. Exits non-zero if any
# test or fuzz target failed or did not build.
# Run as root: the cross-host tests create network namespaces.
set -uo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh || exit 1

bazel test //... --keep_going "$@"
bazel_status=$?

# Test code never reaches what users run: no testonly target (the software
# NIC, the harnesses, the probes) among the deps of the binaries. Bazel would
# refuse to build a non-testonly binary on a testonly dep; this case shows it
# holds and names any offender. One case.
structure_passed=0
structure_failed=0
testonly_deps=$(bazel query --noshow_progress \
  'attr(testonly, 1, deps(//daemon:rdma-agentd + //client:rdma-agentctl))' \
  2>/dev/null)
query_status=$?
if [[ $query_status -eq 0 && -z $testonly_deps ]]; then
  echo "structure: no testonly target in the deps of rdma-agentd and rdma-agentctl: PASS"
  structure_passed=1
else
  echo "structure: testonly targets in the deps of the binaries (query exit $query_status): FAIL"
  echo "$testonly_deps"
  structure_failed=1
fi

# Formatting: clang-format over the C++ sources, sorted BUILD lists. One
# case per check.
format_results=$(tools/check_format.sh)
echo "$format_results"
format_passed=$(grep -c ': PASS$' <<<"$format_results")
format_failed=$(grep -c ': FAIL' <<<"$format_results")

# Each fuzz target is one case: PASS, or FAIL on a crash or a failed build.
fuzz_passed=0
fuzz_failed=0
if [[ ${RDMA_AGENTD_FUZZ:-1} != 0 ]]; then
  fuzz_results=$(mktemp)
  FUZZ_RESULTS=$fuzz_results tools/fuzz.sh --ci
  fuzz_status=$?
  fuzz_passed=$(grep -c ' PASS$' "$fuzz_results")
  fuzz_failed=$(grep -c ' FAIL$' "$fuzz_results")
  # Failed before any target ran (no clang, no targets): one failed case.
  if [[ $fuzz_status -ne 0 && $fuzz_failed -eq 0 ]]; then
    fuzz_failed=1
  fi
  rm -f "$fuzz_results"
fi

# Counts every test case of this run's test targets (not cached stale ones).
read -r passed failed < <(python3 - <<'PY'
import glob, xml.etree.ElementTree as ET
passed = failed = 0
for path in glob.glob("bazel-testlogs/**/test.xml", recursive=True):
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        failed += 1
        continue
    cases = root.iter("testcase")
    found = False
    for case in cases:
        found = True
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.find("skipped") is not None or case.get("result") == "skipped":
            continue
        else:
            passed += 1
    if not found:
        # A target whose runner wrote no test cases counts as one.
        suites = list(root.iter("testsuite"))
        bad = any(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
        failed += 1 if bad else 0
        passed += 0 if bad else 1
print(passed, failed)
PY
)

# A target that failed to build or crashed leaves no test cases behind; make
# sure the count can never read as green then.
if [[ $bazel_status -ne 0 && ${failed:-0} -eq 0 ]]; then
  failed=1
fi
passed=$((${passed:-0} + fuzz_passed + structure_passed + format_passed))
failed=$((${failed:-0} + fuzz_failed + structure_failed + format_failed))
echo "${passed} passed, ${failed} failed"
[[ $bazel_status -eq 0 && $failed -eq 0 ]]
