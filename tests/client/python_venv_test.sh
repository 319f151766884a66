#!/bin/bash
# Installs the rdma-agent wheel into a fresh venv (Debian's /usr/bin/python3,
# --system-site-packages for python3-grpcio, python3-protobuf, python3-torch
# and python3-numpy; pip --no-index: nothing is downloaded) and runs a test
# program with that venv's Python, so that `rdma_agent` comes from the
# installed copy and never from the tree:
#   python_venv_test.sh TEST.py [ARGS...]
# The program gets --agentd (the rdma-agentd runfile) after ARGS.
set -euo pipefail
runfiles="${TEST_SRCDIR}/rdma_agentd"
venv="$(mktemp -d "${TEST_TMPDIR:-/tmp}/venv.XXXXXX")"
trap 'rm -rf "$venv"' EXIT
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --no-index --disable-pip-version-check \
  "${runfiles}/client/python/rdma_agent-0.1.0-py3-none-any.whl"
unset PYTHONPATH
# No __pycache__ next to the runfiles (they link into the source tree).
export PYTHONDONTWRITEBYTECODE=1
test="$1"
shift
cd "$venv"
"$venv/bin/python" "${runfiles}/tests/client/${test}" "$@" \
  --agentd "${runfiles}/daemon/rdma-agentd"
