"""deploy/monitoring against real processes: promtool checks and unit-tests
the rules; two real rdma-agentd processes move bytes over tcp while Debian's
prometheus scrapes them with the rules loaded; every expression of the rules
and the Grafana dashboard names only metrics the agents expose, and
Prometheus evaluates each one without error.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

import yaml

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", "."), "rdma_agentd")
MONITORING = os.path.join(RUNFILES, "deploy", "monitoring")
RULES = os.path.join(MONITORING, "rdma-agentd.rules.yml")
RULES_TEST = os.path.join(MONITORING, "rdma-agentd.rules.test.yml")
DASHBOARD = os.path.join(MONITORING, "grafana-dashboard.json")
AGENTD = os.path.join(RUNFILES, "daemon", "rdma-agentd")
AGENTCTL = os.path.join(RUNFILES, "client", "rdma-agentctl")
# PromQL words that look like metric names but are not.
PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "clamp_min", "and",
    "offset", "deriv", "predict_linear", "le", "instance", "job", "up",
    "backend", "op", "code", "kind", "device", "port", "direction", "from",
    "to", "reason", "version", "revision",
}


def rule_expressions():
    with open(RULES) as f:
        rules = yaml.safe_load(f)
    return [(rule.get("record") or rule.get("alert"), rule["expr"])
            for group in rules["groups"] for rule in group["rules"]]


def dashboard_expressions():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    return [(panel["title"], target["expr"])
            for panel in dashboard["panels"] for target in panel["targets"]]


def metric_names(expr):
    """The metric names an expression reads (not recording rules' names,
    label names, functions or strings)."""
    expr = re.sub(r'"[^"]*"', '""', expr)           # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)            # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)          # ranges, $__rate_interval
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)
    names = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", expr))
    return {n for n in names
            if n not in PROMQL_WORDS and ":" not in n
            and not re.fullmatch(r"[0-9e]+|[smhd]", n)}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


class Agent:
    """A real rdma-agentd with the tcp backend and a metrics endpoint."""

    def __init__(self, root, name):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir)
        self.log = open(os.path.join(self.dir, "log"), "w")
        self.process = subprocess.Popen(
            [AGENTD, "--runtime_dir=" + self.dir,
             "--state_dir=" + os.path.join(self.dir, "state"),
             "--backends=memory,tcp", "--tcp_listen=127.0.0.1:0",
             "--peer_listen=127.0.0.1:0", "--advertise_host=127.0.0.1",
             "--metrics_listen=127.0.0.1:0", "--log_level=info"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.target = "unix://" + os.path.join(self.dir, "agent.sock")
        deadline = time.time() + 30
        while True:
            result = self.ctl("-o", "json", "info", check=False)
            if result.returncode == 0:
                self.metrics = json.loads(result.stdout)["metrics_address"]
                return
            if time.time() > deadline or self.process.poll() is not None:
                raise RuntimeError("agent did not start: " + result.stderr)
            time.sleep(0.1)

    def ctl(self, *args, check=True):
        return subprocess.run([AGENTCTL, "--target=" + self.target] + list(args),
                              capture_output=True, text=True, check=check,
                              timeout=60)

    def stop(self):
        self.process.kill()
        self.process.wait()
        self.log.close()


def field(output, key):
    for line in output.splitlines():
        if line.startswith(key + ": "):
            return line[len(key) + 2:]
    raise AssertionError("no %s in %r" % (key, output))


@unittest.skipUnless(shutil.which("promtool"), "promtool is not installed")
class RulesTest(unittest.TestCase):
    def test_rules_are_valid(self):
        result = subprocess.run(["promtool", "check", "rules", RULES],
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_rules_fire_when_they_should(self):
        result = subprocess.run(["promtool", "test", "rules", RULES_TEST],
                                capture_output=True, text=True,
                                cwd=MONITORING)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("SUCCESS", result.stdout)

    def test_every_alert_the_operators_need_is_there(self):
        alerts = {name for name, _ in rule_expressions()}
        for alert in ("RdmaAgentDown", "RdmaAgentRegistrationsNearLimit",
                      "RdmaAgentOpErrorRate", "RdmaAgentRailDown",
                      "RdmaAgentNotificationsDropped", "RdmaAgentFdGrowth",
                      "RdmaAgentMemoryGrowth"):
            self.assertIn(alert, alerts)
        # Each alert is tested in the promtool file.
        with open(RULES_TEST) as f:
            tested = {case["alertname"] for test in yaml.safe_load(f)["tests"]
                      for case in test.get("alert_rule_test", [])}
        for name, _ in rule_expressions():
            if not name.startswith("instance:"):
                self.assertIn(name, tested)


@unittest.skipUnless(shutil.which("prometheus"), "prometheus is not installed")
class RealPrometheusTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="mon.", dir="/tmp")
        cls.agents = [Agent(cls.root, "a"), Agent(cls.root, "b")]
        a, b = cls.agents
        # A moves bytes to and from B: B's serving side counts them.
        src = a.ctl("register", "--size=1MiB").stdout
        dst = b.ctl("register", "--size=1MiB").stdout
        a.ctl("submit", "--local=" + field(src, "buffer_id"),
              "--context=" + field(dst, "context"),
              "--op=write,length=1MiB", "--op=read,length=64k")
        cls.scrapes = [http_get("http://%s/metrics" % agent.metrics)
                       for agent in cls.agents]
        # Prometheus with the rules, scraping both every second.
        cls.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [RULES],
            "scrape_configs": [{
                "job_name": "rdma-agentd",
                "static_configs": [{"targets": [agent.metrics
                                                for agent in cls.agents]}],
            }],
        }
        config_path = os.path.join(cls.root, "prometheus.yml")
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f)
        cls.prometheus_log = open(os.path.join(cls.root, "prometheus.log"), "w")
        cls.prometheus = subprocess.Popen(
            ["prometheus", "--config.file=" + config_path,
             "--storage.tsdb.path=" + os.path.join(cls.root, "tsdb"),
             "--web.listen-address=127.0.0.1:%d" % cls.port],
            stdout=cls.prometheus_log, stderr=subprocess.STDOUT)
        cls.api = "http://127.0.0.1:%d/api/v1/" % cls.port

    @classmethod
    def tearDownClass(cls):
        cls.prometheus.kill()
        cls.prometheus.wait()
        cls.prometheus_log.close()
        for agent in cls.agents:
            agent.stop()
        shutil.rmtree(cls.root, ignore_errors=True)

    def query(self, expr):
        url = self.api + "query?" + urllib.parse.urlencode({"query": expr})
        answer = json.loads(http_get(url))
        self.assertEqual(answer["status"], "success", (expr, answer))
        return answer["data"]["result"]

    def eventually(self, expr, condition, timeout=60):
        deadline = time.time() + timeout
        while True:
            try:
                result = self.query(expr)
                if condition(result):
                    return result
            except OSError:
                pass  # not listening yet
            if time.time() > deadline:
                with open(os.path.join(self.root, "prometheus.log")) as f:
                    self.fail("%s never held; prometheus log:\n%s"
                              % (expr, f.read()[-3000:]))
            time.sleep(0.5)

    def exposed(self):
        """Every family the agents expose (from '# TYPE' lines)."""
        families = set()
        for text in self.scrapes:
            families |= set(re.findall(r"^# TYPE (\S+) ", text, re.M))
        return families

    def test_prometheus_scrapes_both_agents(self):
        up = self.eventually('up{job="rdma-agentd"} == 1',
                             lambda result: len(result) == 2)
        self.assertEqual({r["metric"]["instance"] for r in up},
                         {agent.metrics for agent in self.agents})
        # B served A's WRITE of 1 MiB and its READ of 64 KiB.
        b = self.agents[1].metrics
        served = self.eventually(
            'rdma_agentd_served_bytes_total{backend="tcp",instance="%s"}' % b,
            lambda result: len(result) == 2)
        by_op = {r["metric"]["op"]: float(r["value"][1]) for r in served}
        self.assertEqual(by_op, {"write": 1 << 20, "read": 64 << 10})

    def test_rules_load_and_evaluate(self):
        groups = self.eventually(
            "up", lambda result: len(result) == 2) and json.loads(
                http_get(self.api + "rules"))["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        self.assertEqual(len(rules), len(rule_expressions()))
        for rule in rules:
            self.assertEqual(rule["health"], "ok", rule)
        # The recording rule has a value for each agent once it has run.
        self.eventually("instance:rdma_agentd_registered_bytes:ratio",
                        lambda result: len(result) == 2)

    def test_every_expression_names_exposed_metrics_and_evaluates(self):
        self.eventually("up", lambda result: len(result) == 2)
        exposed = self.exposed() | {"up"}
        for where, expr in rule_expressions() + dashboard_expressions():
            for name in metric_names(expr):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                self.assertTrue(name in exposed or base in exposed,
                                "%s: %s is not a metric the agents expose"
                                % (where, name))
            # Valid PromQL, as Grafana would send it.
            self.query(expr.replace("$__rate_interval", "1m"))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]], verbosity=2)
