#!/bin/bash
# Type-checks the rdma_agent package (with its generated stubs and their
# .pyi files) with mypy and client/python/mypy.ini: every function of the
# package annotated, and the annotations consistent.
set -euo pipefail
cd "${TEST_SRCDIR}/rdma_agentd/client/python"
exec mypy --config-file mypy.ini --cache-dir "${TEST_TMPDIR}/mypy" -p rdma_agent
