"""The deployment files say what an operator relies on.

Parses the Kubernetes manifests, the Dockerfile and the flag file and checks
the fields that matter; runs `systemd-analyze verify` and `security` on the
systemd unit (skipped only where systemd-analyze is absent).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import yaml

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", "."), "rdma_agentd")
DEPLOY = os.path.join(RUNFILES, "deploy")
# systemd-analyze security's "Overall exposure level"; 0 is best, 10 worst.
MAX_EXPOSURE = 4.0


def load(name):
    with open(os.path.join(DEPLOY, "kubernetes", name)) as f:
        return yaml.safe_load(f)


def probe_command(container, probe):
    return container[probe]["exec"]["command"]


def env(container):
    return {e["name"]: e for e in container.get("env", [])}


class DaemonSetTest(unittest.TestCase):
    def setUp(self):
        self.ds = load("daemonset.yaml")
        self.pod = self.ds["spec"]["template"]["spec"]
        self.agent = self.pod["containers"][0]

    def test_runs_on_every_node_including_tainted_ones(self):
        self.assertEqual(self.ds["kind"], "DaemonSet")
        self.assertIn({"operator": "Exists"}, self.pod["tolerations"])
        self.assertEqual(self.pod["priorityClassName"], "system-node-critical")

    def test_peers_reach_the_node_address(self):
        self.assertTrue(self.pod["hostNetwork"])
        self.assertIn("--advertise_host=$(NODE_IP)", self.agent["args"])
        self.assertEqual(env(self.agent)["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"],
                         "status.hostIP")

    def test_prometheus_finds_the_metrics_endpoint(self):
        self.assertIn("--metrics_listen=$(NODE_IP):9464", self.agent["args"])
        self.assertIn({"containerPort": 9464, "name": "metrics"},
                      self.agent["ports"])
        annotations = self.ds["spec"]["template"]["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/scrape"], "true")
        self.assertEqual(annotations["prometheus.io/port"], "9464")

    def test_probes_ask_the_agents_health_over_its_socket(self):
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            command = probe_command(self.agent, probe)
            self.assertEqual(command[0], "/usr/local/bin/rdma-agentctl", probe)
            self.assertIn("health", command, probe)
        # Ready means the API itself serves (NOT_SERVING during shutdown).
        self.assertIn("--service=rdma.agent.v1.RdmaAgent",
                      probe_command(self.agent, "readinessProbe"))

    def test_rdma_needs_ipc_lock_and_the_device_resource(self):
        security = self.agent["securityContext"]
        self.assertEqual(security["capabilities"]["drop"], ["ALL"])
        self.assertEqual(security["capabilities"]["add"], ["IPC_LOCK"])
        self.assertFalse(security["allowPrivilegeEscalation"])
        self.assertIn("rdma/hca_shared_devices_a", self.agent["resources"]["limits"])

    def test_apps_share_the_runtime_dir_and_the_id_survives_restarts(self):
        mounts = {m["name"]: m["mountPath"] for m in self.agent["volumeMounts"]}
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        self.assertEqual(mounts["run"], "/run/rdma-agentd")
        self.assertEqual(volumes["run"]["hostPath"]["path"], "/run/rdma-agentd")
        self.assertEqual(mounts["state"], "/var/lib/rdma-agentd")
        self.assertEqual(volumes["state"]["hostPath"]["path"], "/var/lib/rdma-agentd")


class KubernetesObjectsTest(unittest.TestCase):
    """The DaemonSet's companions, and what holds them together."""

    def setUp(self):
        self.ds = load("daemonset.yaml")
        self.pod = self.ds["spec"]["template"]["spec"]
        self.agent = self.pod["containers"][0]

    def test_no_service_account_token(self):
        account = load("serviceaccount.yaml")
        self.assertEqual(account["kind"], "ServiceAccount")
        self.assertFalse(account["automountServiceAccountToken"])
        self.assertEqual(self.pod["serviceAccountName"],
                         account["metadata"]["name"])
        self.assertFalse(self.pod["automountServiceAccountToken"])

    def test_runs_only_on_rdma_nodes(self):
        terms = (self.pod["affinity"]["nodeAffinity"]
                 ["requiredDuringSchedulingIgnoredDuringExecution"]
                 ["nodeSelectorTerms"])
        expressions = [e for t in terms for e in t["matchExpressions"]]
        self.assertIn({"key": "feature.node.kubernetes.io/rdma.available",
                       "operator": "In", "values": ["true"]}, expressions)

    def test_flags_come_from_the_configmap_which_is_the_flag_file(self):
        configmap = load("configmap.yaml")
        self.assertEqual(configmap["kind"], "ConfigMap")
        with open(os.path.join(DEPLOY, "rdma-agentd.flags")) as f:
            self.assertEqual(configmap["data"]["rdma-agentd.flags"], f.read())
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in self.agent["volumeMounts"]}
        configmap_volumes = [n for n, v in volumes.items() if "configMap" in v]
        self.assertEqual(len(configmap_volumes), 1)
        name = configmap_volumes[0]
        self.assertEqual(volumes[name]["configMap"]["name"],
                         configmap["metadata"]["name"])
        self.assertEqual(self.agent["args"][0], "--flagfile=%s/rdma-agentd.flags"
                         % mounts[name])

    def test_the_built_agent_accepts_the_configmap_and_the_args(self):
        configmap = load("configmap.yaml")
        with tempfile.NamedTemporaryFile("w", suffix=".flags") as flags:
            flags.write(configmap["data"]["rdma-agentd.flags"])
            flags.flush()
            args = ["--flagfile=" + flags.name] + [
                a.replace("$(NODE_IP)", "127.0.0.1") for a in self.agent["args"][1:]]
            agentd = os.path.join(RUNFILES, "daemon", "rdma-agentd")
            result = subprocess.run([agentd] + args + ["--only_check_args"],
                                    capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_podmonitor_scrapes_the_agents_as_job_rdma_agentd(self):
        monitor = load("podmonitor.yaml")
        self.assertEqual(monitor["apiVersion"], "monitoring.coreos.com/v1")
        self.assertEqual(monitor["kind"], "PodMonitor")
        labels = self.ds["spec"]["template"]["metadata"]["labels"]
        for key, value in monitor["spec"]["selector"]["matchLabels"].items():
            self.assertEqual(labels[key], value)
        # The rules in deploy/monitoring select job="rdma-agentd".
        self.assertEqual(labels[monitor["spec"]["jobLabel"]], "rdma-agentd")
        ports = {p["name"] for p in self.agent["ports"]}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            self.assertIn(endpoint["port"], ports)
            self.assertEqual(endpoint["path"], "/metrics")

    def test_memory_limit_is_documented_for_kv_caches(self):
        with open(os.path.join(DEPLOY, "kubernetes", "daemonset.yaml")) as f:
            text = f.read()
        self.assertIn("--max_registered_bytes_", text)
        self.assertIn("--max_agent_allocated_bytes_", text)
        self.assertIn("memory", self.agent["resources"]["limits"])


# The Kubernetes fields the manifests may use, by where they appear: a
# misspelt or misplaced field (which kubectl would refuse or silently drop)
# fails here.
OBJECT_FIELDS = {"apiVersion", "kind", "metadata", "spec", "data",
                 "automountServiceAccountToken"}
METADATA_FIELDS = {"name", "namespace", "labels", "annotations"}
POD_SPEC_FIELDS = {
    "containers", "initContainers", "volumes", "securityContext",
    "serviceAccountName", "automountServiceAccountToken", "affinity",
    "nodeSelector", "tolerations", "priorityClassName", "hostNetwork",
    "dnsPolicy", "terminationGracePeriodSeconds", "restartPolicy",
}
CONTAINER_FIELDS = {
    "name", "image", "command", "args", "env", "ports", "securityContext",
    "resources", "volumeMounts", "startupProbe", "livenessProbe",
    "readinessProbe", "restartPolicy",
}
VOLUME_SOURCES = {"hostPath", "configMap", "emptyDir", "csi", "secret"}
HOST_PATH_TYPES = {"Directory", "DirectoryOrCreate"}


def pod_specs(obj):
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    if obj["kind"] == "DaemonSet":
        return [obj["spec"]["template"]["spec"]]
    return []


class ManifestShapeTest(unittest.TestCase):
    def setUp(self):
        self.objects = []
        for name in sorted(os.listdir(os.path.join(DEPLOY, "kubernetes"))):
            if name.endswith(".yaml"):
                with open(os.path.join(DEPLOY, "kubernetes", name)) as f:
                    for obj in yaml.safe_load_all(f):
                        self.objects.append((name, obj))

    def test_every_manifest_is_there(self):
        kinds = {obj["kind"] for _, obj in self.objects}
        self.assertEqual(kinds, {"DaemonSet", "ServiceAccount", "ConfigMap",
                                 "PodMonitor", "Pod"})

    def test_objects_use_known_fields(self):
        for name, obj in self.objects:
            self.assertLessEqual(set(obj), OBJECT_FIELDS, name)
            self.assertLessEqual(set(obj["metadata"]), METADATA_FIELDS, name)
            self.assertTrue(obj["metadata"]["name"], name)
            for spec in pod_specs(obj):
                self.assertLessEqual(set(spec), POD_SPEC_FIELDS, name)
                for container in spec.get("containers", []) + spec.get(
                        "initContainers", []):
                    self.assertLessEqual(set(container), CONTAINER_FIELDS,
                                         "%s: %s" % (name, container["name"]))

    def test_mounts_name_volumes_and_volumes_are_well_formed(self):
        for name, obj in self.objects:
            for spec in pod_specs(obj):
                volumes = {v["name"]: v for v in spec.get("volumes", [])}
                for volume in volumes.values():
                    sources = set(volume) - {"name"}
                    self.assertEqual(len(sources), 1, (name, volume))
                    self.assertLessEqual(sources, VOLUME_SOURCES, (name, volume))
                    if "hostPath" in volume:
                        self.assertIn(volume["hostPath"]["type"],
                                      HOST_PATH_TYPES, (name, volume))
                for container in spec.get("containers", []) + spec.get(
                        "initContainers", []):
                    for mount in container.get("volumeMounts", []):
                        self.assertIn(mount["name"], volumes,
                                      "%s: %s" % (name, container["name"]))

    def test_references_resolve(self):
        names = {(obj["kind"], obj["metadata"]["name"]) for _, obj in self.objects}
        for name, obj in self.objects:
            for spec in pod_specs(obj):
                if "serviceAccountName" in spec:
                    self.assertIn(("ServiceAccount", spec["serviceAccountName"]),
                                  names, name)
                for volume in spec.get("volumes", []):
                    if "configMap" in volume:
                        self.assertIn(("ConfigMap", volume["configMap"]["name"]),
                                      names, name)


class SidecarTest(unittest.TestCase):
    def setUp(self):
        self.pod = load("sidecar-example.yaml")["spec"]

    def test_agent_is_a_native_sidecar(self):
        # An init container with restartPolicy Always starts before the app
        # and does not keep a Job from completing.
        agents = [c for c in self.pod["initContainers"] if c["name"] == "rdma-agentd"]
        self.assertEqual(len(agents), 1)
        agent = agents[0]
        self.assertEqual(agent["restartPolicy"], "Always")
        self.assertIn("health", probe_command(agent, "startupProbe"))
        self.assertEqual(agent["securityContext"]["capabilities"]["add"], ["IPC_LOCK"])
        self.assertIn("rdma/hca_shared_devices_a", agent["resources"]["limits"])
        self.assertFalse(any(c["name"] == "rdma-agentd" for c in self.pod["containers"]))

    def test_app_finds_the_socket_through_the_environment(self):
        app = [c for c in self.pod["containers"] if c["name"] == "app"][0]
        self.assertEqual(env(app)["RDMA_AGENT_SOCKET"]["value"],
                         "/run/rdma-agentd/agent.sock")
        self.assertNotIn("RDMA_AGENT_TARGET", env(app))  # read by nothing
        self.assertIn("/run/rdma-agentd", [m["mountPath"] for m in app["volumeMounts"]])


class AppPodTest(unittest.TestCase):
    def test_app_pod_reaches_the_node_agent(self):
        pod = load("app-pod-example.yaml")["spec"]
        app = pod["containers"][0]
        self.assertEqual(env(app)["RDMA_AGENT_SOCKET"]["value"],
                         "/run/rdma-agentd/agent.sock")
        volume = [v for v in pod["volumes"] if v["name"] == "rdma-agentd"][0]
        self.assertEqual(volume["hostPath"]["path"], "/run/rdma-agentd")
        # It may start before the agent has created the directory.
        self.assertEqual(volume["hostPath"]["type"], "DirectoryOrCreate")


class ImageTest(unittest.TestCase):
    def setUp(self):
        with open(os.path.join(DEPLOY, "Dockerfile")) as f:
            self.dockerfile = f.read()

    def test_runs_as_a_non_root_user_with_a_healthcheck(self):
        users = re.findall(r"^USER\s+(\S+)", self.dockerfile, re.M)
        self.assertTrue(users, "no USER line")
        self.assertNotIn(users[-1].split(":")[0], ("root", "0"))
        healthcheck = re.search(r"^HEALTHCHECK .*\n\s*CMD (.*)$", self.dockerfile, re.M)
        self.assertIsNotNone(healthcheck)
        self.assertIn("rdma-agentctl", healthcheck.group(1))
        self.assertIn("health", healthcheck.group(1))

    def test_builds_optimized(self):
        self.assertRegex(self.dockerfile, r"bazel build -c opt //daemon:rdma-agentd")

    def test_build_context_leaves_out_git_and_bazel_outputs(self):
        with open(os.path.join(RUNFILES, ".dockerignore")) as f:
            ignored = f.read().split()
        self.assertIn(".git", ignored)
        self.assertIn("bazel-*", ignored)


class FlagFileTest(unittest.TestCase):
    def test_does_not_open_listeners_on_every_interface(self):
        with open(os.path.join(DEPLOY, "rdma-agentd.flags")) as f:
            active = [l for l in f.read().splitlines() if l.startswith("--")]
        self.assertFalse([l for l in active if "0.0.0.0" in l], active)


class DirectoryDeploymentTest(unittest.TestCase):
    """The etcd directory is shown, off by default, and its files come from
    the Secret the DaemonSet mounts."""

    def setUp(self):
        with open(os.path.join(DEPLOY, "rdma-agentd.flags")) as f:
            self.lines = f.read().splitlines()
        # The commented example flags: "# --name=value".
        self.example = [l[2:] for l in self.lines if l.startswith("# --directory")]
        self.pod = load("daemonset.yaml")["spec"]["template"]["spec"]
        self.agent = self.pod["containers"][0]

    def test_the_default_stays_local(self):
        active = [l for l in self.lines if l.startswith("--directory")]
        self.assertEqual(active, [])
        self.assertFalse([a for a in self.agent["args"] if a.startswith("--directory")])

    def test_the_etcd_lines_name_tls_auth_and_the_secret_mount(self):
        names = {l.split("=", 1)[0] for l in self.example}
        self.assertEqual(names, {"--directory", "--directory_ca_file", "--directory_cert_file",
                                 "--directory_key_file", "--directory_user",
                                 "--directory_password_file"})
        mounts = {m["name"]: m for m in self.agent["volumeMounts"]}
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        secret = volumes["etcd"]["secret"]
        self.assertEqual(secret["secretName"], "rdma-agentd-etcd")
        self.assertTrue(secret["optional"])  # pods start without it (local)
        self.assertEqual(secret["defaultMode"], 0o400)
        self.assertTrue(mounts["etcd"]["readOnly"])
        for line in self.example:
            if line.split("=", 1)[0].endswith("_file"):
                self.assertTrue(line.split("=", 1)[1].startswith(
                    mounts["etcd"]["mountPath"] + "/"), line)

    def test_the_built_agent_accepts_the_etcd_lines(self):
        agentd = os.path.join(RUNFILES, "daemon", "rdma-agentd")
        active = [l for l in self.lines if l.startswith("--")]
        # Client certificates or a user: each alternative on its own.
        alternatives = {
            "client certificate": ("--directory_user", "--directory_password_file"),
            "user and password": ("--directory_cert_file", "--directory_key_file"),
        }
        for kept, dropped in alternatives.items():
            with self.subTest(kept), tempfile.NamedTemporaryFile("w", suffix=".flags") as flags:
                etcd = [l for l in self.example if not l.startswith(dropped)]
                flags.write("\n".join(active + etcd) + "\n")
                flags.flush()
                result = subprocess.run(
                    [agentd, "--flagfile=" + flags.name, "--only_check_args"],
                    capture_output=True, text=True)
                self.assertEqual(result.returncode, 0, result.stdout + result.stderr)


def install_destinations(text):
    """{installed path: source} for every `install [-D] [-m MODE] SRC... DEST`
    line of `text` (shell, or a comment of the unit)."""
    installed = {}
    for line in re.findall(r"^[#\s]*install\s+(.*)$", text, re.M):
        words = re.sub(r"\s#.*$", "", line).split()
        files = []
        i = 0
        while i < len(words):
            if words[i] == "-m":
                i += 2
                continue
            if not words[i].startswith("-"):
                files.append(words[i])
            i += 1
        *sources, dest = files
        for source in sources:
            path = dest + os.path.basename(source) if dest.endswith("/") else dest
            installed[path] = source
    return installed


class SystemdDocumentationTest(unittest.TestCase):
    def test_documentation_names_files_the_install_steps_install(self):
        with open(os.path.join(DEPLOY, "rdma-agentd.service")) as f:
            unit = f.read()
        with open(os.path.join(RUNFILES, "docs", "OPERATING.md")) as f:
            operating = f.read()
        urls = " ".join(re.findall(r"^Documentation=(.*)$", unit, re.M)).split()
        self.assertTrue(urls, "no Documentation=")
        # The unit's own install comment and OPERATING.md's systemd steps.
        for steps in (unit, operating):
            installed = install_destinations(steps)
            for url in urls:
                self.assertTrue(url.startswith("file://"), url)
                path = url[len("file://"):]
                self.assertIn(path, installed, "nothing installs " + url)
                # ... from a file that is in the repository.
                self.assertTrue(
                    os.path.isfile(os.path.join(RUNFILES, installed[path])),
                    installed[path])


@unittest.skipUnless(shutil.which("systemd-analyze"), "systemd-analyze is not installed")
class SystemdUnitTest(unittest.TestCase):
    def setUp(self):
        with open(os.path.join(DEPLOY, "rdma-agentd.service")) as f:
            self.unit = f.read()
        # The unit names the installed binary; check it against the built one.
        agentd = os.path.join(RUNFILES, "daemon", "rdma-agentd")
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "rdma-agentd.service")
        with open(self.path, "w") as f:
            f.write(self.unit.replace("/usr/local/bin/rdma-agentd", agentd))

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_verifies(self):
        result = subprocess.run(["systemd-analyze", "verify", self.path],
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stderr.strip(), "")

    def test_exposure_is_low(self):
        result = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", self.path],
            capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        level = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
        self.assertIsNotNone(level, result.stdout)
        self.assertLessEqual(float(level.group(1)), MAX_EXPOSURE, result.stdout)

    def setting(self, name):
        """The value of the last `name=` line of the unit."""
        values = re.findall(r"^%s=(.*)$" % re.escape(name), self.unit, re.M)
        self.assertTrue(values, "no %s=" % name)
        return values[-1].strip()

    def exec_start(self):
        return self.setting("ExecStart").split()

    def test_tells_systemd_when_it_serves_and_that_it_lives(self):
        # The agent sends READY=1, WATCHDOG=1 and STOPPING=1 from its main
        # process (daemon/main_loop.h).
        self.assertEqual(self.setting("Type"), "notify")
        self.assertEqual(self.setting("NotifyAccess"), "main")
        watchdog = re.fullmatch(r"(\d+)s", self.setting("WatchdogSec"))
        self.assertIsNotNone(watchdog, "WatchdogSec in whole seconds")
        # Pings come every half interval, and not while the main thread runs
        # the shutdown (up to --shutdown_grace, 5 s): leave room for both.
        self.assertGreaterEqual(int(watchdog.group(1)), 10)
        self.assertIn(self.setting("Restart"), ("on-failure", "always"))

    def test_keeps_the_agent_id_in_its_state_directory(self):
        state = self.setting("StateDirectory")
        self.assertIn("--state_dir=%%S/%s" % state, self.exec_start())
        # The runtime dir goes when the agent stops: the id must not live there.
        self.assertFalse([a for a in self.exec_start()
                          if a.startswith("--state_dir=%t")])

    def test_the_built_binary_accepts_the_command_line(self):
        # Every flag of ExecStart and of the flag file is one the agent knows.
        args = [a.replace("%S", self.dir)
                 .replace("/etc/rdma-agentd.flags",
                          os.path.join(DEPLOY, "rdma-agentd.flags"))
                for a in self.exec_start()[1:]]
        agentd = os.path.join(RUNFILES, "daemon", "rdma-agentd")
        result = subprocess.run([agentd] + args + ["--only_check_args"],
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_ordering_and_hardening_that_rdma_allows(self):
        self.assertRegex(self.unit, r"After=.*rdma-hw\.target")
        for line in ("DynamicUser=yes", "StateDirectory=rdma-agentd",
                     "RuntimeDirectory=rdma-agentd", "LimitMEMLOCK=infinity",
                     "DeviceAllow=char-infiniband_verbs rw", "TasksMax="):
            self.assertIn(line, self.unit)
        self.assertNotIn("PrivateUsers=yes", self.unit)  # would hide callers' uids

    def test_memory_is_bounded_where_the_agent_sees_it(self):
        # The agent derives its registered-bytes total from its cgroup's
        # limit, so MemoryMax refuses registrations instead of OOM-killing.
        self.assertRegex(self.setting("MemoryMax"), r"^\d+%$")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]], verbosity=2)
