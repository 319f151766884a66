"""Generates C++ (and optionally gRPC) code from .proto files with the system protoc."""

def cc_proto_grpc_library(name, srcs, deps = [], grpc = True, visibility = None):
    """A cc_library with the messages (and services) of `srcs`.

    Args:
      name: target name.
      srcs: .proto files, relative to this package; their import paths are
        relative to this package too (e.g. "rdma/agent/v1/agent.proto").
      deps: other cc_proto_grpc_library targets whose protos these import.
      grpc: also run grpc_cpp_plugin.
      visibility: as usual.
    """
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc"]
        if grpc:
            outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    pkg = native.package_name()
    cmd = "protoc -I{pkg} -I$(GENDIR)/{pkg} --cpp_out=$(GENDIR)/{pkg} ".format(pkg = pkg)
    if grpc:
        cmd += "--grpc_out=$(GENDIR)/{pkg} --plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin) ".format(pkg = pkg)
    cmd += " ".join(["$(location {})".format(s) for s in srcs])
    native.genrule(
        name = name + "_gen",
        srcs = srcs + [d + "_srcs" for d in deps],
        outs = outs,
        cmd = cmd,
    )
    native.filegroup(
        name = name + "_srcs",
        srcs = srcs,
        visibility = visibility,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        includes = ["."],
        copts = ["-Wno-unused-parameter"],
        deps = deps + [
            "//third_party:grpc",
            "//third_party:protobuf",
        ],
        visibility = visibility,
    )
