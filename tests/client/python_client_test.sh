#!/bin/bash
# Runs python_client_test.py with Debian's /usr/bin/python3 (the one with
# python3-grpcio and python3-protobuf), the client and its generated stubs
# on PYTHONPATH, against the rdma-agentd runfile.
set -euo pipefail
runfiles="${TEST_SRCDIR}/rdma_agentd"
export PYTHONPATH="${runfiles}/client/python"
exec /usr/bin/python3 "${runfiles}/tests/client/python_client_test.py" \
  --agentd "${runfiles}/daemon/rdma-agentd"
