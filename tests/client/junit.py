"""Runs unittest cases and writes each one to Bazel's test XML.

Bazel reads $XML_OUTPUT_FILE when a test writes it, so every Python case
is counted (tools/test.sh counts <testcase> elements) instead of the whole
target as one.
"""

import os
import sys
import time
import unittest
import xml.etree.ElementTree as ET


class _Recorder(unittest.TextTestResult):
    """A verbose text result that also keeps each case's outcome and time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cases = []  # (test id, seconds, kind or None, text)
        self._started = 0.0

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test, kind=None, text=""):
        self.cases.append((test.id(), time.monotonic() - self._started, kind, text))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failure", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            kind = "failure" if issubclass(err[0], test.failureException) else "error"
            self._record(subtest, kind, self._exc_info_to_string(err, test))


def _write_xml(path, name, cases):
    suite = ET.Element("testsuite", name=name, tests=str(len(cases)),
                       failures=str(sum(1 for c in cases if c[2] == "failure")),
                       errors=str(sum(1 for c in cases if c[2] == "error")))
    for test_id, seconds, kind, text in cases:
        classname, _, method = test_id.rpartition(".")
        case = ET.SubElement(suite, "testcase", classname=classname, name=method,
                             time="%.3f" % seconds)
        if kind is not None:
            ET.SubElement(case, kind, message=text.strip().splitlines()[-1] if text else "")
            case[-1].text = text
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main(module="__main__", argv=None):
    """unittest.main for `module`; returns the exit status (0 when all passed)."""
    program = unittest.main(module=module, argv=argv, exit=False, verbosity=2,
                            testRunner=unittest.TextTestRunner(resultclass=_Recorder,
                                                               verbosity=2))
    result = program.result
    path = os.environ.get("XML_OUTPUT_FILE")
    if path:
        _write_xml(path, os.path.basename(sys.argv[0]), result.cases)
    return 0 if result.wasSuccessful() else 1
