#!/usr/bin/env bash
# Bazel's --workspace_status_command for stamped builds (--config=release):
# the source revision `rdma-agentd --version` prints. Outside a git checkout
# (a docker build context has no .git) it prints nothing, and the binary says
# its revision is unknown.
rev=$(git rev-parse --short=12 HEAD 2>/dev/null) || exit 0
echo "BUILD_SCM_REVISION ${rev}"
if git diff --quiet HEAD -- 2>/dev/null; then
  echo "BUILD_SCM_STATUS clean"
else
  echo "BUILD_SCM_STATUS modified"
fi
