"""The Helm chart (helm/statestore-async): lint, Kubernetes schema validation, and the rendered
manifests -- socket directory on a hostPath, hardening, probes, config checksum, no secrets in the
ConfigMap, and a statestore.toml that the daemon's own ``load_config`` accepts.

helm comes from ``STATESTORE_HELM`` (``make test`` sets it) or ``.cache/helm/helm``
(``make helm-bin``); without it these tests fail rather than skip.
"""
from __future__ import annotations

import json
import os
import posixpath
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from statestore_async.config import FIELDS, load_config

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "statestore-async"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
K8S_VERSIONS = ("1.29.0", "1.33.0")  # kubernetes-validate 1.37.0 ships schemas for 1.25-1.37
CRD_KINDS = {"ServiceMonitor", "SparkApplication"}  # no schema offline: a WARN is expected
SENSITIVE_AWS = ("AWS_SECRET", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "aws_secret", "secret_access_key")


# --- running helm ---------------------------------------------------------------------------------

def _helm_path() -> str:
    env = os.environ.get("STATESTORE_HELM")
    candidates = [Path(env)] if env else []
    candidates.append(ROOT / ".cache" / "helm" / "helm")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    pytest.fail(
        "helm not found (looked at STATESTORE_HELM=%r and %s): run `make helm-bin` "
        "(or `make test`, which does it)" % (env, candidates[-1]),
        pytrace=False,
    )


@pytest.fixture(scope="session")
def helm() -> str:
    return _helm_path()


def test_helm_binary_available():
    """Without helm the chart tests error at setup; this one FAILS with the remedy."""
    proc = subprocess.run([_helm_path(), "version", "--short"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("v4."), proc.stdout + proc.stderr


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc


def template(helm: str, *args: str) -> str:
    return run_helm(helm, "template", "t", str(CHART), "--namespace", "spark", *args).stdout


def parse(manifest: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(manifest) if d]


class Render:
    """One ``helm template`` output, parsed."""

    def __init__(self, text: str):
        self.text = text
        self.docs = parse(text)

    def kinds(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict:
        found = [d for d in self.kinds(kind) if d["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {[d['metadata']['name'] for d in found]}"
        return found[0]

    @property
    def daemonset(self) -> dict:
        return self.one("DaemonSet")

    @property
    def pod_spec(self) -> dict:
        return self.daemonset["spec"]["template"]["spec"]

    @property
    def daemon(self) -> dict:
        (c,) = [c for c in self.pod_spec["containers"] if c["name"] == "daemon"]
        return c

    @property
    def config_map(self) -> dict:
        return self.one("ConfigMap", "statestore-async")

    @property
    def toml_text(self) -> str:
        return self.config_map["data"]["statestore.toml"]

    @property
    def toml(self) -> dict:
        return tomllib.loads(self.toml_text)

    @property
    def checksum(self) -> str:
        return self.daemonset["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


def render(helm: str, *args: str) -> Render:
    return Render(template(helm, *args))


@pytest.fixture(scope="session")
def rendered(helm) -> dict[str, Render]:
    """Every ci/*-values.yaml rendered once."""
    return {p.name: render(helm, "-f", str(p)) for p in CI_VALUES}


def ci_ids():
    return [p.name for p in CI_VALUES]


def _values(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / name).read_text()) or {}


def test_ci_values_files_present():
    names = {p.name for p in CI_VALUES}
    assert {"default-values.yaml", "s3-existing-secret-values.yaml", "irsa-values.yaml",
            "metrics-values.yaml", "dashboards-values.yaml"} <= names
    for p in CI_VALUES:
        assert _values(p.name)["objectStore"]["root"], p.name


# --- lint and schema validation -------------------------------------------------------------------

@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_lint_strict(helm, values):
    proc = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def kubernetes_validate(manifest: str, version: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "-k", version, "--strict", "-"],
                          input=manifest, capture_output=True, text=True, timeout=120)


def _problems(proc: subprocess.CompletedProcess) -> list[str]:
    """Lines that are not an INFO pass nor a WARN about a CRD kind without a schema."""
    bad = []
    for line in (proc.stdout + proc.stderr).splitlines():
        if not line.strip() or line.startswith("INFO"):
            continue
        if line.startswith("WARN") and any(f"kind {k} " in line for k in CRD_KINDS):
            continue
        bad.append(line)
    return bad


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_kubernetes_validate_strict(rendered, values, version):
    r = rendered[values.name]
    proc = kubernetes_validate(r.text, version)
    assert proc.returncode == 0 and not _problems(proc), proc.stdout + proc.stderr
    passed = proc.stdout.count("INFO - passed")
    built_in = [d for d in r.docs if d["kind"] not in CRD_KINDS]
    assert passed == len(built_in), proc.stdout


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_executor_pod_template_is_a_valid_pod(rendered, version):
    tpl = rendered["default-values.yaml"].one("ConfigMap", "spark-executor-pod-template")
    pod = yaml.safe_load(tpl["data"]["executor-pod-template.yaml"])
    pod["metadata"] = {"name": "executor"}
    for c in pod["spec"]["containers"]:
        c["image"] = "spark"
    proc = kubernetes_validate(yaml.safe_dump(pod), version)
    assert proc.returncode == 0 and not _problems(proc), proc.stdout + proc.stderr


# --- invalid values fail, naming the field --------------------------------------------------------

BAD_VALUES = {
    "string-for-int": (["--set-string", "daemon.maxBatch=lots"], ["/daemon/maxBatch", "integer"]),
    "string-for-int-file": ({"snapshots": {"interval": "ten"}}, ["/snapshots/interval", "integer"]),
    "missing-root": ([], ["/objectStore/root"]),
    "null-root": (["--set", "objectStore.root=null"], ["objectStore", "root"]),
    "bad-root": (["--set", "objectStore.root=gs://bucket"], ["/objectStore/root"]),
    "unknown-top-key": (["--set", "bogus=1"], ["bogus"]),
    "unknown-nested-key": ({"daemon": {"memoryBudgett": "1GiB"}}, ["/daemon", "memoryBudgett"]),
    "bad-enum": (["--set", "s3.sse=AES128"], ["/s3/sse"]),
    "bad-size": (["--set", "daemon.memoryBudget=lots"], ["/daemon/memoryBudget"]),
    "octal-mode-as-int": ({"socket": {"mode": 432}}, ["/socket/mode"]),
    "retention-below-2": (["--set", "snapshots.retentionVersions=1"], ["/snapshots/retentionVersions"]),
    "dashboard-label-value-int": ({"dashboards": {"enabled": True, "labelValue": 1}}, ["/dashboards/labelValue"]),
    "dashboard-bad-label": (["--set", "dashboards.label=grafana dashboard"], ["/dashboards/label"]),
}
# Checked by the templates (`fail`), not by the schema: `helm lint` only logs a template's `fail`
# (at INFO level), so these fail `helm template` / `helm install` only.
BAD_VALUES_TEMPLATE_ONLY = {
    "grace-not-above-drain": (["--set", "terminationGracePeriodSeconds=60"], ["terminationGracePeriodSeconds",
                                                                             "drainTimeout"]),
    "monitor-without-service": (["--set", "metrics.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
                                 "--set", "metrics.service.enabled=false"], ["metrics.service.enabled"]),
}


def _bad_args(case, tmp_path) -> list[str]:
    extra, _ = {**BAD_VALUES, **BAD_VALUES_TEMPLATE_ONLY}[case]
    base = [] if case == "missing-root" else ["--set", "objectStore.root=s3://bucket/p"]
    if isinstance(extra, dict):
        f = tmp_path / "bad-values.yaml"
        f.write_text(yaml.safe_dump(extra))
        return base + ["-f", str(f)]
    return base + extra


@pytest.mark.parametrize("command", ["lint", "template"])
@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_invalid_values_fail_naming_the_field(helm, tmp_path, case, command):
    args = _bad_args(case, tmp_path)
    if command == "lint":
        proc = run_helm(helm, "lint", "--strict", str(CHART), *args, check=False)
    else:
        proc = run_helm(helm, "template", "t", str(CHART), *args, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for needle in BAD_VALUES[case][1]:
        assert needle in out, f"{needle!r} not in:\n{out}"


@pytest.mark.parametrize("case", sorted(BAD_VALUES_TEMPLATE_ONLY))
def test_inconsistent_values_fail_template(helm, tmp_path, case):
    proc = run_helm(helm, "template", "t", str(CHART), *_bad_args(case, tmp_path), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for needle in BAD_VALUES_TEMPLATE_ONLY[case][1]:
        assert needle in out, f"{needle!r} not in:\n{out}"


# --- the DaemonSet --------------------------------------------------------------------------------

@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_socket_directory_is_a_hostpath_directory(rendered, values):
    r = rendered[values.name]
    socket = r.toml["socket"]
    socket_dir = posixpath.dirname(socket)
    vals = _values(values.name).get("socket", {})
    assert socket == f"{vals.get('hostDir', '/var/run/statestore-async')}/{vals.get('name', 'daemon.sock')}"

    volumes = {v["name"]: v for v in r.pod_spec["volumes"]}
    host_paths = [v["hostPath"] for v in volumes.values() if "hostPath" in v]
    assert all(h["path"] != socket for h in host_paths), "the socket FILE must never be a hostPath"
    mounts = {m["mountPath"]: m for m in r.daemon["volumeMounts"]}
    assert socket not in mounts, "the socket FILE must never be mounted"
    mount = mounts[socket_dir]
    vol = volumes[mount["name"]]["hostPath"]
    assert vol == {"path": socket_dir, "type": "DirectoryOrCreate"}
    assert not mount.get("subPath") and not mount.get("readOnly")
    # the daemon gets the socket path only from its config file
    env = {e["name"]: e for e in r.daemon["env"]}
    assert env["STATESTORE_CONFIG"]["value"] == "/etc/statestore-async/statestore.toml"
    assert mounts["/etc/statestore-async"]["readOnly"] is True
    assert volumes[mounts["/etc/statestore-async"]["name"]]["configMap"]["name"] == r.config_map["metadata"]["name"]
    assert r.daemon["command"] == ["statestore-async", "serve"]
    assert r.daemon["args"] == ["--config", "/etc/statestore-async/statestore.toml"]
    # readOnlyRootFilesystem needs a writable /tmp
    assert volumes[mounts["/tmp"]["name"]] == {"name": mounts["/tmp"]["name"], "emptyDir": {}}


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_cache_volume(rendered, values):
    r = rendered[values.name]
    cache = _values(values.name).get("cache", {})
    cache_dir = r.toml["cache_dir"]
    mounts = {m["mountPath"]: m["name"] for m in r.daemon["volumeMounts"]}
    volumes = {v["name"]: v for v in r.pod_spec["volumes"]}
    if cache.get("enabled", True) is False:
        assert cache_dir == "" and "cache" not in volumes
        return
    vol = volumes[mounts[cache_dir]]
    if cache.get("type", "emptyDir") == "hostPath":
        assert vol["hostPath"] == {"path": cache["hostPath"], "type": "DirectoryOrCreate"}
        init = r.pod_spec["initContainers"][0]
        assert cache_dir in init["command"]
    else:
        assert "emptyDir" in vol


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_security_context(rendered, values):
    r = rendered[values.name]
    sc = r.daemon["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 10001
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    pod_sc = r.pod_spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == 10001
    assert r.pod_spec["automountServiceAccountToken"] is False
    # The only root process is the init container that chowns the host directories: no
    # capability beyond chown/chmod, no escalation.
    for init in r.pod_spec.get("initContainers", []):
        isc = init["securityContext"]
        assert isc["allowPrivilegeEscalation"] is False and isc["readOnlyRootFilesystem"] is True
        assert isc["capabilities"]["drop"] == ["ALL"]
        assert set(isc["capabilities"]["add"]) <= {"CHOWN", "FOWNER", "FSETID"}


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_probes_use_the_health_cli(rendered, values):
    r = rendered[values.name]
    socket = r.toml["socket"]
    for probe, flags in (("livenessProbe", []), ("readinessProbe", ["--ready"])):
        cmd = r.daemon[probe]["exec"]["command"]
        assert cmd[:4 + len(flags)] == ["statestore-async", "health", *flags, "--socket", socket], cmd
        assert "--timeout" in cmd
        # kubelet's own timeout is longer than the CLI's, so the CLI reports the failure
        assert r.daemon[probe]["timeoutSeconds"] > float(cmd[cmd.index("--timeout") + 1])


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_graceful_drain_and_rolling_update(rendered, values):
    r = rendered[values.name]
    pre_stop = r.daemon["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = r.pod_spec["terminationGracePeriodSeconds"]
    assert grace > r.toml["drain_timeout"] + float(pre_stop[1])
    strategy = r.daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"]
    assert strategy["rollingUpdate"]["maxSurge"] == 0


def test_scheduling_values(rendered):
    r = rendered["irsa-values.yaml"]
    v = _values("irsa-values.yaml")
    assert r.pod_spec["nodeSelector"] == v["nodeSelector"]
    assert r.pod_spec["tolerations"] == v["tolerations"]
    assert r.pod_spec["priorityClassName"] == "system-node-critical"
    assert r.daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "10%"
    assert r.daemon["resources"] == v["resources"]
    # the helm test pod lands on the same kind of node
    test_pod = r.one("Pod", "test-roundtrip")["spec"]
    assert test_pod["nodeSelector"] == v["nodeSelector"] and test_pod["tolerations"] == v["tolerations"]
    d = rendered["default-values.yaml"].pod_spec
    assert "nodeSelector" not in d and "tolerations" not in d and "priorityClassName" not in d


def test_other_pods_are_not_selected_by_the_daemonset(rendered):
    """A DaemonSet adopts orphan pods its selector matches: the test pod must not match."""
    for r in rendered.values():
        selector = r.daemonset["spec"]["selector"]["matchLabels"]
        assert selector.items() <= r.daemonset["spec"]["template"]["metadata"]["labels"].items()
        test_labels = r.one("Pod", "test-roundtrip")["metadata"]["labels"]
        assert not selector.items() <= test_labels.items()


# --- checksum/config ------------------------------------------------------------------------------

def test_checksum_changes_with_the_config_only(helm, rendered):
    base_args = ["-f", str(CHART / "ci" / "default-values.yaml")]
    base = rendered["default-values.yaml"]
    assert len(base.checksum) == 64
    assert render(helm, *base_args).checksum == base.checksum, "the checksum must be deterministic"
    for change in (["--set", "daemon.logLevel=debug"], ["--set", "snapshots.retentionVersions=7"],
                   ["--set", "s3.region=eu-central-1"], ["--set", "socket.name=other.sock"]):
        assert render(helm, *base_args, *change).checksum != base.checksum, change
    same = render(helm, *base_args, "--set", "image.tag=9.9.9", "--set", "resources.limits.memory=5Gi",
                  "--set", "podAnnotations.team=streaming", "--set", "s3.existingSecret=other-keys",
                  "--set", "serviceAccount.annotations.x=y")
    assert same.checksum == base.checksum
    assert same.daemonset["spec"]["template"]["metadata"]["annotations"]["team"] == "streaming"


# --- secrets --------------------------------------------------------------------------------------

def test_no_secret_in_config_maps(helm, rendered):
    fake = ["--set", "s3.existingSecret=zz-fake-secret-name", "--set", "s3.accessKeyIdKey=zz-fake-access-key",
            "--set", "s3.secretAccessKeyKey=zz-fake-secret-key", "--set", "s3.sessionTokenKey=zz-fake-token-key"]
    r = render(helm, "-f", str(CHART / "ci" / "s3-existing-secret-values.yaml"), *fake)
    env = {e["name"]: e for e in r.daemon["env"]}
    expected = {"AWS_ACCESS_KEY_ID": "zz-fake-access-key", "AWS_SECRET_ACCESS_KEY": "zz-fake-secret-key",
                "AWS_SESSION_TOKEN": "zz-fake-token-key"}
    for var, key in expected.items():
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "zz-fake-secret-name", "key": key}
    for render_ in [r, *rendered.values()]:
        assert not render_.kinds("Secret"), "the chart must not create Secrets"
        for cm in render_.kinds("ConfigMap"):
            text = yaml.safe_dump(cm)
            assert "zz-fake" not in text, cm["metadata"]["name"]
            for s in SENSITIVE_AWS:
                assert s.lower() not in text.lower(), (s, cm["metadata"]["name"])
    # without existingSecret no key variables at all (IRSA / workload identity)
    irsa_env = {e["name"] for e in rendered["irsa-values.yaml"].daemon["env"]}
    assert not {v for v in irsa_env if v.startswith("AWS_")}


def test_service_account_carries_the_cloud_identity_and_no_rbac(rendered):
    irsa = rendered["irsa-values.yaml"]
    sa = irsa.one("ServiceAccount")
    role_arn = _values("irsa-values.yaml")["serviceAccount"]["annotations"]["eks.amazonaws.com/role-arn"]
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == role_arn
    assert irsa.pod_spec["serviceAccountName"] == sa["metadata"]["name"]
    for r in rendered.values():
        assert not {d["kind"] for d in r.docs} & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}


# --- statestore.toml ------------------------------------------------------------------------------

def _load(tmp_path, r: Render):
    path = tmp_path / "statestore.toml"
    path.write_text(r.toml_text)
    return load_config(str(path), env={})


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_config_toml_loads_with_the_daemons_loader(rendered, tmp_path, values):
    r = rendered[values.name]
    assert set(r.toml) == set(FIELDS), "statestore.toml keys must be exactly the DaemonConfig fields"
    cfg = _load(tmp_path, r)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    v = _values(values.name)

    def val(*path):
        for src in (v, defaults):
            node = src
            for p in path:
                node = node.get(p) if isinstance(node, dict) else None
            if node is not None:
                return node
        raise KeyError(path)

    gib = 1 << 30
    mib = 1 << 20
    assert cfg.socket == f"{val('socket', 'hostDir')}/{val('socket', 'name')}"
    assert cfg.socket_mode == int(val("socket", "mode"), 8)
    assert cfg.allowed_uids == tuple(dict.fromkeys([10001, *val("socket", "allowedUids")]))
    assert cfg.log_level == val("daemon", "logLevel") and cfg.log_format == val("daemon", "logFormat")
    assert cfg.loop == val("daemon", "loop")
    assert cfg.max_batch == val("daemon", "maxBatch") and cfg.max_inflight == val("daemon", "maxInflight")
    assert cfg.snapshot_interval == val("snapshots", "interval")
    assert cfg.retention_versions == val("snapshots", "retentionVersions")
    assert cfg.upload_concurrency == val("upload", "concurrency")
    assert cfg.drain_timeout == float(val("upload", "drainTimeout"))
    assert cfg.upload_queue_bytes == 256 * mib and cfg.snapshot_delta_bytes == 256 * mib
    assert cfg.s3_endpoint_url == val("s3", "endpointUrl") and cfg.s3_region == val("s3", "region")
    assert cfg.s3_sse == val("s3", "sse") and cfg.s3_kms_key_id == val("s3", "kmsKeyId")
    assert cfg.s3_addressing_style == val("s3", "addressingStyle")
    assert cfg.metrics_port == (val("metrics", "port") if val("metrics", "enabled") else 0)
    assert cfg.metrics_host == val("metrics", "host")
    assert cfg.cache_dir == (val("cache", "mountPath") if val("cache", "enabled") else "")
    expected_budget = {"irsa-values.yaml": 6 * gib}.get(values.name, 2 * gib)
    assert cfg.memory_budget == expected_budget
    assert cfg.spill_min_bytes == mib and cfg.block_cache_bytes == 0  # 0: a quarter of the budget
    expected_cache = {"s3-existing-secret-values.yaml": 20 * gib}.get(values.name, 10 * gib)
    assert cfg.cache_bytes == expected_cache


def test_config_numbers_render_exactly(helm, tmp_path):
    """Large integers must not turn into floats (Helm reads YAML numbers as float64)."""
    f = tmp_path / "numbers.yaml"
    f.write_text("upload:\n  drainTimeout: 30.5\n")  # --set would pass 30.5 as a string
    r = render(helm, "--set", "objectStore.root=s3://b", "--set", "daemon.memoryBudget=12884901888",
               "--set", "daemon.maxFrameBytes=1048576", "-f", str(f),
               "--set", "snapshots.deltaBytes=1.5GiB", "--set", "socket.mode=0600",
               "--set", "socket.allowedUids={185,10001,2000}", "--set", "terminationGracePeriodSeconds=40")
    assert "e+" not in r.toml_text
    cfg = _load(tmp_path, r)
    assert cfg.memory_budget == 12884901888 and cfg.max_frame_bytes == 1 << 20
    assert cfg.drain_timeout == 30.5 and cfg.snapshot_delta_bytes == int(1.5 * (1 << 30))
    assert cfg.socket_mode == 0o600 and cfg.allowed_uids == (10001, 185, 2000)


def test_metrics(rendered):
    r = rendered["metrics-values.yaml"]
    port = r.toml["metrics_port"]
    assert port == 9464 and r.toml["metrics_host"] == "0.0.0.0"
    assert r.daemon["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
    svc = r.one("Service", "-metrics")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= r.daemonset["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    sm = r.one("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    np_ = r.one("NetworkPolicy")
    assert np_["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np_["spec"]["ingress"]
    assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
    assert rule["from"] == _values("metrics-values.yaml")["networkPolicy"]["metricsFrom"]
    d = rendered["default-values.yaml"]
    assert d.toml["metrics_port"] == 0 and "ports" not in d.daemon
    assert not d.kinds("Service") and not d.kinds("ServiceMonitor") and not d.kinds("NetworkPolicy")


def test_grafana_dashboard_config_map(helm, rendered):
    """dashboards.enabled renders the dashboard JSON of the chart, unchanged, in a ConfigMap that the
    Grafana sidecar picks up by its label (tests/test_dashboard.py checks the JSON itself)."""
    shipped = json.loads((CHART / "dashboards" / "statestore-async.json").read_text())
    r = rendered["dashboards-values.yaml"]
    cm = r.one("ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Streaming"}
    assert list(cm["data"]) == ["statestore-async.json"]
    assert json.loads(cm["data"]["statestore-async.json"]) == shipped
    # off by default, in every other ci values file
    for name, other in rendered.items():
        if name != "dashboards-values.yaml":
            assert not [c for c in other.kinds("ConfigMap") if c["metadata"]["name"].endswith("-dashboard")], name
    # another sidecar label, and the release's namespace when none is given
    custom = render(helm, "--set", "objectStore.root=s3://b", "--set", "dashboards.enabled=true",
                    "--set", "dashboards.label=example.com/dashboard", "--set-string", "dashboards.labelValue=yes")
    labels = custom.one("ConfigMap", "-dashboard")["metadata"]["labels"]
    assert labels["example.com/dashboard"] == "yes" and "grafana_dashboard" not in labels
    assert custom.one("ConfigMap", "-dashboard")["metadata"]["namespace"] == "spark"


def test_network_policy_without_metrics_denies_all_ingress(helm):
    r = render(helm, "--set", "objectStore.root=s3://b", "--set", "networkPolicy.enabled=true")
    assert r.one("NetworkPolicy")["spec"]["ingress"] == []


# --- helm test and the Spark examples -------------------------------------------------------------

@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_helm_test_pod_runs_selftest_through_the_socket(rendered, values):
    r = rendered[values.name]
    pod = r.one("Pod", "test-roundtrip")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    socket = r.toml["socket"]
    assert c["command"] == ["statestore-async", "selftest", "--socket", socket,
                            "--root", _values(values.name)["objectStore"]["root"]]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == posixpath.dirname(socket)]
    assert volumes[mount["name"]]["hostPath"]["path"] == posixpath.dirname(socket)
    assert c["securityContext"]["runAsNonRoot"] is True


def _assert_mounts_socket_dir(spec_volumes, container, socket, gid_holder):
    socket_dir = posixpath.dirname(socket)
    volumes = {v["name"]: v for v in spec_volumes}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == socket_dir]
    assert volumes[mount["name"]]["hostPath"] == {"path": socket_dir, "type": "DirectoryOrCreate"}
    assert all(m["mountPath"] != socket for m in container["volumeMounts"])
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["STATESTORE_SOCKET"] == socket
    assert 10001 in gid_holder["supplementalGroups"]


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids())
def test_executor_pod_template_mounts_the_socket_dir(rendered, values):
    r = rendered[values.name]
    cm = r.one("ConfigMap", "spark-executor-pod-template")
    pod = yaml.safe_load(cm["data"]["executor-pod-template.yaml"])
    assert pod["kind"] == "Pod"
    container = pod["spec"]["containers"][0]
    _assert_mounts_socket_dir(pod["spec"]["volumes"], container, r.toml["socket"], pod["spec"]["securityContext"])
    assert pod["spec"].get("nodeSelector") == r.pod_spec.get("nodeSelector")


def test_spark_application_example(rendered):
    assert not rendered["default-values.yaml"].kinds("SparkApplication")
    r = rendered["irsa-values.yaml"]
    app = r.one("SparkApplication")
    assert app["apiVersion"] == "sparkoperator.k8s.io/v1beta2"
    spec = app["spec"]
    socket = r.toml["socket"]
    ex = spec["executor"]
    _assert_mounts_socket_dir(spec["volumes"], ex, socket, ex["podSecurityContext"])
    assert spec["sparkConf"]["spark.executorEnv.STATESTORE_SOCKET"] == socket
    assert ex["nodeSelector"] == r.pod_spec["nodeSelector"]


def test_notes_explain_the_executor_setup(helm):
    proc = run_helm(helm, "install", "t", str(CHART), "--dry-run=client", "--namespace", "spark",
                    "--set", "objectStore.root=s3://b/p")
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "STATESTORE_SOCKET=/var/run/statestore-async/daemon.sock" in notes
    assert "spark.kubernetes.executor.podTemplateFile" in notes
    assert "spark.executorEnv.STATESTORE_SOCKET" in notes
