#!/bin/bash
# tools/workspace_status.sh: in a git checkout, the revision and whether the
# tree is modified; outside one (a docker build context), nothing and success.
set -euo pipefail
script="${TEST_SRCDIR}/rdma_agentd/tools/workspace_status.sh"
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/status.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
export GIT_CEILING_DIRECTORIES="$work"
commit() { git -c user.name=test -c user.email=test@example.com commit -q "$@"; }

mkdir "$work/plain"
out=$(cd "$work/plain" && "$script") || fail "exits non-zero outside git"
[[ -z "$out" ]] || fail "prints outside git: $out"

mkdir "$work/repo"
cd "$work/repo"
git init -q .
echo one >file && git add file && commit -m one
out=$("$script")
grep -qx "BUILD_SCM_REVISION $(git rev-parse --short=12 HEAD)" <<<"$out" ||
  fail "no revision in: $out"
grep -qx "BUILD_SCM_STATUS clean" <<<"$out" || fail "not clean: $out"
echo two >file
out=$("$script")
grep -qx "BUILD_SCM_STATUS modified" <<<"$out" || fail "not modified: $out"
echo PASS
