"""The docs cannot drift from the binary: every flag `rdma-agentd --helpfull`
lists is in docs/OPERATING.md's flag tables exactly once, with its default,
and nothing else is; every flag docs/SECURITY.md's limits table names exists,
with its default where that is a number."""

import os
import re
import subprocess
import unittest

RUNFILES = os.path.join(os.environ["TEST_SRCDIR"], "rdma_agentd")
# absl's own flags, not the agent's.
ABSL_FLAGS = {"flagfile", "fromenv", "tryfromenv", "undefok"}


def helpfull_defaults():
    """{flag: default} from --helpfull, quotes around strings removed."""
    out = subprocess.run(
        [os.path.join(RUNFILES, "daemon/rdma-agentd"), "--helpfull"],
        check=True, capture_output=True, text=True).stdout
    flags = {}
    # Each flag's entry starts with "    --name (" and runs to the next one;
    # its default ends it: "; default: VALUE;".
    for chunk in re.split(r"\n(?=    --)", out):
        match = re.match(r"\s*--(\w+) \(", chunk)
        if not match:
            continue
        text = " ".join(chunk.split("\n\n")[0].split())
        assert "); default: " in text and text.endswith(";"), text
        value = text.rsplit("; default: ", 1)[1][:-1]
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        flags[match.group(1)] = value
    return {k: v for k, v in flags.items() if k not in ABSL_FLAGS}


def table_rows(path):
    """(flag, default cell) of every table row that starts with a flag."""
    rows = []
    with open(os.path.join(RUNFILES, path)) as f:
        for line in f:
            match = re.match(r"\| `--(\w+)` \| ([^|]*) \|", line)
            if match:
                rows.append((match.group(1), match.group(2).strip()))
    return rows


def section(path, heading):
    with open(os.path.join(RUNFILES, path)) as f:
        text = f.read()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


class DocsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.flags = helpfull_defaults()

    def test_helpfull_lists_the_agents_flags(self):
        # The parse itself works: a few flags every agent has.
        for name in ("runtime_dir", "max_rpcs", "tcp_listen", "ibverbs_enable"):
            self.assertIn(name, self.flags)
        self.assertGreater(len(self.flags), 50)

    def test_operating_lists_every_flag_once_with_its_default(self):
        rows = table_rows("docs/OPERATING.md")
        names = [name for name, _ in rows]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        self.assertEqual(duplicates, [], "flags listed more than once")
        self.assertEqual(sorted(set(self.flags) - set(names)), [],
                         "flags of --helpfull missing from docs/OPERATING.md")
        self.assertEqual(sorted(set(names) - set(self.flags)), [],
                         "flags in docs/OPERATING.md the binary does not have")
        for name, cell in rows:
            documented = "" if cell == "(empty)" else cell.strip("`")
            self.assertEqual(documented, self.flags[name],
                             "default of --%s in docs/OPERATING.md" % name)

    def test_security_limits_name_real_flags_and_their_numbers(self):
        limits = section("docs/SECURITY.md", "## Limits")
        rows = [(m.group(1), m.group(2).strip()) for m in re.finditer(
            r"^\| `--(\w+)` \| ([^|]*) \|", limits, re.M)]
        self.assertGreater(len(rows), 10)
        for name, cell in rows:
            self.assertIn(name, self.flags,
                          "docs/SECURITY.md names --%s, which does not exist"
                          % name)
            # A flag whose default is 0 derives its value from the host;
            # the table gives what it derives to.
            if re.fullmatch(r"\d+", cell) and self.flags[name] != "0":
                self.assertEqual(cell, self.flags[name],
                                 "default of --%s in docs/SECURITY.md" % name)

    def test_flag_file_names_real_flags_and_the_memory_limits(self):
        # Set and commented-out examples alike: an operator uncomments them.
        with open(os.path.join(RUNFILES, "deploy/rdma-agentd.flags")) as f:
            text = f.read()
        named = re.findall(r"^#? ?--(\w+)=", text, re.M)
        self.assertGreater(len(named), 5)
        for name in named:
            self.assertIn(name, self.flags,
                          "deploy/rdma-agentd.flags names --%s" % name)
        # A KV-cache node's operator finds both memory limits there.
        for name in ("max_registered_bytes_per_user",
                     "max_agent_allocated_bytes_total"):
            self.assertIn(name, named)


if __name__ == "__main__":
    unittest.main()
