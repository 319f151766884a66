#!/bin/sh
# Builds the rdma-agent wheel from the package files Bazel hands over:
#   build_wheel.sh OUT.whl FILE...
# Each FILE is a source (client/python/...) or a generated stub
# (bazel-out/.../client/python/...); both are copied to their place under
# client/python in a staging tree, then Debian's python3-build makes the
# wheel there without network or isolation.
set -eu
out="$1"
shift
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
for file in "$@"; do
  relative="client/python/${file#*client/python/}"
  mkdir -p "$stage/$(dirname "$relative")"
  cp "$file" "$stage/$relative"
done
HOME="$stage" /usr/bin/python3 -m build --no-isolation --skip-dependency-check \
  --wheel --outdir "$stage/dist" "$stage/client/python" >"$stage/build.log" 2>&1 || {
  cat "$stage/build.log" >&2
  exit 1
}
cp "$stage/dist/$(basename "$out")" "$out"
