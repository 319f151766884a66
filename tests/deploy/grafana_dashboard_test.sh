#!/bin/bash
# Grafana is not packaged for Debian, so the dashboard is checked against
# Grafana's own dashboard schema instead: the TypeScript types published as
# @grafana/schema (tools/install-deps.sh installs them and tsc). The JSON is
# compiled as an object literal that `satisfies` the schema's Dashboard, so
# unknown or misspelt fields and wrong value types are errors. A copy with a
# misspelt field must fail, or the check checks nothing.
set -euo pipefail
tools="${RDMA_AGENTD_NODE_TOOLS:-/usr/local/lib/rdma-agentd/node-tools}/node_modules"
dashboard="${TEST_SRCDIR}/rdma_agentd/deploy/monitoring/grafana-dashboard.json"
if [[ ! -x "$tools/.bin/tsc" || ! -d "$tools/@grafana/schema" ]]; then
  echo "FAIL: tsc and @grafana/schema are not in $tools (run tools/install-deps.sh)"
  exit 1
fi
work="${TEST_TMPDIR:-$(mktemp -d)}"
schema="$tools/@grafana/schema/dist/types/raw/dashboard/x/types.gen"

# $1: the dashboard JSON, $2: the .ts file to write.
write_check() {
  {
    echo "import type { Dashboard } from '$schema';"
    printf 'export const dashboard = ('
    cat "$1"
    echo ') satisfies Dashboard;'
  } > "$2"
}

tsc() {
  node "$tools/typescript/bin/tsc" --noEmit --strict --target es2022 \
    --module esnext --moduleResolution bundler "$@"
}

write_check "$dashboard" "$work/dashboard.ts"
if ! tsc "$work/dashboard.ts"; then
  echo "FAIL: deploy/monitoring/grafana-dashboard.json does not fit Grafana's dashboard schema"
  exit 1
fi
echo "PASS: the dashboard fits @grafana/schema's Dashboard"

sed 's/"title": "rdma-agentd"/"titel": "rdma-agentd"/' "$dashboard" > "$work/misspelt.json"
write_check "$work/misspelt.json" "$work/misspelt.ts"
if out=$(tsc "$work/misspelt.ts" 2>&1); then
  echo "FAIL: a misspelt field passed the check"
  exit 1
fi
if ! grep -q "titel" <<<"$out"; then
  echo "FAIL: the misspelt field was not what failed: $out"
  exit 1
fi
echo "PASS: a misspelt field fails the check"
