#!/bin/bash
# Runs monitoring_test.py with Debian's /usr/bin/python3 (python3-yaml).
set -euo pipefail
exec /usr/bin/python3 "${TEST_SRCDIR}/rdma_agentd/tests/deploy/monitoring_test.py"
