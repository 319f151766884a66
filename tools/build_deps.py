#!/usr/bin/env python3
"""Checks (or with --fix, makes) every `deps`, `srcs`, `hdrs` and `data`
list of the BUILD files sorted: labels of the same package (":x") first,
then the rest, each group in byte order, as buildifier orders them.

Usage: tools/build_deps.py [--fix] [BUILD files...]  (default: every
tracked BUILD.bazel). Exits 1 naming each unsorted list when not fixing."""

import re
import subprocess
import sys

LIST = re.compile(r"^(\s*)(deps|srcs|hdrs|data) = \[\n((?:\s*\"[^\"]*\",\n)+)(\s*)\]",
                  re.M)


def key(label):
    return (0 if label.startswith(":") else 1, label)


def process(path, fix):
    with open(path) as f:
        text = f.read()
    bad = []

    def sort(match):
        items = re.findall(r"\"([^\"]*)\"", match.group(3))
        ordered = sorted(dict.fromkeys(items), key=key)
        if ordered != items:
            line = text.count("\n", 0, match.start()) + 1
            bad.append("%s:%d: %s not sorted" % (path, line, match.group(2)))
        indent = re.match(r"(\s*)", match.group(3)).group(1)
        body = "".join('%s"%s",\n' % (indent, item) for item in ordered)
        return "%s%s = [\n%s%s]" % (match.group(1), match.group(2), body,
                                     match.group(4))

    fixed = LIST.sub(sort, text)
    if fix and fixed != text:
        with open(path, "w") as f:
            f.write(fixed)
    return bad


def main(argv):
    fix = "--fix" in argv
    paths = [a for a in argv if a != "--fix"] or subprocess.run(
        ["git", "ls-files", "*BUILD.bazel", "BUILD.bazel"],
        check=True, capture_output=True, text=True).stdout.split()
    bad = []
    for path in paths:
        bad += process(path, fix)
    if bad and not fix:
        print("\n".join(bad))
        print("%d unsorted lists; tools/build_deps.py --fix sorts them" % len(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
