"""fuzz_test: one libFuzzer target that also runs as an ordinary test."""

def fuzz_test(name, srcs, deps = [], mutations = 1000, size = "small", tags = [], **kwargs):
    """A fuzz target (a source defining LLVMFuzzerTestOneInput) as a cc_test.

    Built normally it links standalone_driver and replays its seed corpus
    corpus/<name>/ plus `mutations` deterministic mutations, so that
    `bazel test //...` runs it with any compiler. Under --config=fuzz it links
    libFuzzer's main (tools/fuzz.sh runs it coverage-guided).
    """
    corpus = "corpus/" + name
    native.cc_test(
        name = name,
        size = size,
        srcs = srcs,
        data = native.glob([corpus + "/*"]),
        args = select({
            ":libfuzzer": ["-runs=%d" % mutations],
            "//conditions:default": ["--mutations=%d" % mutations],
        }) + ["tests/fuzz/" + corpus],
        # One executable with the sanitizer and fuzzer runtimes in it.
        linkstatic = True,
        tags = tags + ["fuzz_target"],
        deps = deps + [":fuzz_check"] + select({
            ":libfuzzer": [],
            "//conditions:default": [":standalone_driver"],
        }),
        **kwargs
    )
