#!/usr/bin/env bash
# Fails on formatting drift: clang-format (Google style, .clang-format) over
# every tracked C++ source, and sorted lists in every BUILD file
# (tools/build_deps.py). Prints one "format: <check>: PASS|FAIL" line per
# check. --fix rewrites the files instead.
set -uo pipefail
cd "$(dirname "$0")/.."

CLANG_FORMAT=${CLANG_FORMAT:-clang-format-14}
mapfile -t sources < <(git ls-files '*.cc' '*.h' | grep -v '^third_party/')
status=0

if [[ ${1:-} == --fix ]]; then
  "$CLANG_FORMAT" -i "${sources[@]}"
  tools/build_deps.py --fix
  exit 0
fi

if "$CLANG_FORMAT" --dry-run -Werror "${sources[@]}" 2>/tmp/clang-format.$$; then
  echo "format: clang-format: PASS"
else
  head -40 /tmp/clang-format.$$
  echo "format: clang-format: FAIL (tools/check_format.sh --fix)"
  status=1
fi
rm -f /tmp/clang-format.$$

if tools/build_deps.py; then
  echo "format: BUILD lists sorted: PASS"
else
  echo "format: BUILD lists sorted: FAIL (tools/check_format.sh --fix)"
  status=1
fi
exit $status
