#!/bin/bash
# Runs docs_test.py with Debian's /usr/bin/python3.
set -euo pipefail
exec /usr/bin/python3 "${TEST_SRCDIR}/rdma_agentd/tests/deploy/docs_test.py"
