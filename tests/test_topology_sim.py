"""A local simulation of the Kubernetes topology the Helm chart deploys (no cluster needed).

The chart is rendered with ``helm template`` (values of ``ci/s3-existing-secret-values.yaml``, with
``objectStore.root`` and ``s3.endpointUrl`` pointed at the session's SeaweedFS), and everything the
simulation runs is taken from the rendered manifests:

* the ConfigMap's ``statestore.toml`` (only the node-local paths -- ``socket`` and ``cache_dir`` --
  rewritten to the simulated node's directories; every other setting is the chart's),
* the DaemonSet: the init container's script, the daemon container's exact ``command`` + ``args``
  (checked against the Dockerfile's ENTRYPOINT + CMD), its env (``valueFrom.secretKeyRef`` resolved
  from a fake Secret holding the SeaweedFS keys under the chart's key names), its volume mounts and
  its readiness probe,
* the ``helm test`` pod's exact command.

Two "nodes" A and B each get a short host directory under /tmp. A pod's volume mounts become a
map container path -> host path (hostPath volumes live under the node's directory, so the daemon
and the test pod of one node share the socket directory as on a real node; emptyDir/configMap
volumes are per pod), and absolute paths under a mount in argv/env/TOML are rewritten through it.

Pod uid: the pods run as ``runAsUser``/``runAsGroup`` (10001) and the chart's ``allowed_uids`` are
``[10001, 185]``. When this test does not run as that uid, every pod process is started in a user
namespace (``unshare --user --map-user=10001 --map-group=10001``) in which the runner's own uid *is*
10001: the daemon then sees uid 10001 for itself and, through SO_PEERCRED, for every client of the
runner's uid (including this test's in-process ``Client``), so ``allowed_uids`` stays unchanged.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from statestore_async.client.clients import Client
from statestore_async.files.names import file_key
from statestore_async.ids import StoreId

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "statestore-async"
SECRET_VALUES = CHART / "ci" / "s3-existing-secret-values.yaml"
NODE_LOCAL_KEYS = ("socket", "cache_dir")  # the only TOML settings a node may change


def _bin_dir() -> Path:
    """Where ``statestore-async`` lives: next to this Python (the project's .venv)."""
    for d in (Path(sys.executable).parent, ROOT / ".venv" / "bin"):
        if (d / "statestore-async").is_file():
            return d
    pytest.fail("statestore-async is not installed next to this Python nor in .venv/bin", pytrace=False)


BIN = _bin_dir()


# --- helm -------------------------------------------------------------------------------------------

def _helm_path() -> str:
    """As tests/test_helm.py: STATESTORE_HELM, else .cache/helm/helm (``make helm-bin``)."""
    env = os.environ.get("STATESTORE_HELM")
    candidates = ([Path(env)] if env else []) + [ROOT / ".cache" / "helm" / "helm"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    pytest.fail(f"helm not found (STATESTORE_HELM={env!r}, {candidates[-1]}): run `make helm-bin`", pytrace=False)


def _render(values: dict, tmp_path: Path) -> list[dict]:
    vf = tmp_path / "sim-values.yaml"
    vf.write_text(yaml.safe_dump(values))
    proc = subprocess.run([_helm_path(), "template", "sim", str(CHART), "--namespace", "spark", "-f", str(vf)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _one(docs: list[dict], kind: str, pred=lambda d: True) -> dict:
    found = [d for d in docs if d["kind"] == kind and pred(d)]
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def _dockerfile_exec_form(instruction: str) -> list[str]:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith(instruction + " "):
            return json.loads(line[len(instruction) + 1:])
    raise AssertionError(f"no {instruction} in the Dockerfile")


# --- the simulated node and pods ---------------------------------------------------------------------

class Node:
    """One simulated node: a short directory under /tmp holding its hostPath dirs and pod volumes."""

    def __init__(self, name: str):
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"ss{name}", dir="/tmp"))

    def host_path(self, path: str) -> Path:
        return self.dir / "host" / path.strip("/")

    def pod_mounts(self, pod: str, pod_spec: dict, container: dict) -> dict[str, Path]:
        """container mountPath -> host directory, for every volume mount of ``container``."""
        volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        mounts = {}
        for m in container.get("volumeMounts", []):
            vol = volumes[m["name"]]
            if "hostPath" in vol:
                host = self.host_path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type") == "DirectoryOrCreate":
                    host.mkdir(parents=True, exist_ok=True)  # kubelet does this
                assert host.is_dir(), f"hostPath {vol['hostPath']} missing on node {self.name}"
            elif "emptyDir" in vol or "configMap" in vol:
                host = self.dir / pod / m["name"]
                host.mkdir(parents=True, exist_ok=True)
            else:
                raise AssertionError(f"volume kind not simulated: {vol}")
            mounts[m["mountPath"].rstrip("/")] = host
        return mounts


def rewrite(value: str, mounts: dict[str, Path]) -> str:
    """An absolute container path under a mount -> the host path; anything else unchanged."""
    best = None
    for mp in mounts:
        if (value == mp or value.startswith(mp + "/")) and (best is None or len(mp) > len(best)):
            best = mp
    if best is None:
        return value
    return str(mounts[best]) + value[len(best):]


def resolve_env(container: dict, secrets: dict) -> dict[str, str]:
    """The container's env: plain values and secretKeyRefs (a missing key fails, as the pod would)."""
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = str(e["value"])
            continue
        ref = e["valueFrom"]["secretKeyRef"]
        assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]], \
            f"env {e['name']}: Secret {ref['name']} has no key {ref['key']} (CreateContainerConfigError)"
        out[e["name"]] = secrets[ref["name"]][ref["key"]]
    return out


def image_env(tmp_dir: Path | None) -> dict[str, str]:
    """What the image gives every process (Dockerfile ENV and the user's HOME), nothing from this host.

    TMPDIR stands for the pod's /tmp emptyDir (no mount namespace here to mount it at /tmp)."""
    env = {"PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    if tmp_dir is not None:
        env["TMPDIR"] = str(tmp_dir)
    return env


def exe(argv: list[str]) -> list[str]:
    """The image's PATH lookup of argv[0] (statestore-async -> .venv/bin/statestore-async)."""
    found = shutil.which(argv[0], path=f"{BIN}:/usr/bin:/bin")
    assert found, f"{argv[0]} not found"
    return [found, *argv[1:]]


@pytest.fixture(scope="module")
def as_user():
    """argv prefix running a process as (uid, gid) of the pod; see the module docstring."""
    cache = {}

    def prefix(uid: int, gid: int) -> list[str]:
        if (uid, gid) == (os.getuid(), os.getgid()):
            return []
        if (uid, gid) not in cache:
            unshare = shutil.which("unshare")
            cmd = [unshare or "unshare", "--user", f"--map-user={uid}", f"--map-group={gid}"]
            ok = unshare and subprocess.run(cmd + ["true"], capture_output=True, timeout=30).returncode == 0
            if not ok:
                pytest.fail(f"cannot run the pods as uid {uid}: needs `unshare --user --map-user` "
                            "(util-linux >= 2.36, user namespaces allowed) or running the test as that uid",
                            pytrace=False)
            cache[(uid, gid)] = cmd
        return cache[(uid, gid)]

    return prefix


def _stop(proc: subprocess.Popen, grace: float = 15.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def _s3(seaweedfs):
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=seaweedfs.endpoint_url, aws_access_key_id=seaweedfs.access_key,
        aws_secret_access_key=seaweedfs.secret_key, region_name="us-east-1")


def _exists(s3, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return True
    except s3.exceptions.ClientError as exc:
        if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
            return False
        raise


# --- the test ----------------------------------------------------------------------------------------

def test_two_nodes_from_the_rendered_chart(seaweedfs, tmp_path, as_user):
    t0 = time.monotonic()
    bucket = seaweedfs.create_bucket()
    root = f"s3://{bucket}/ckpt"

    # 1. Render: the existing-Secret values, pointed at this SeaweedFS (the chart's s3.endpointUrl).
    values = yaml.safe_load(SECRET_VALUES.read_text())
    values["objectStore"]["root"] = root
    values["s3"]["endpointUrl"] = seaweedfs.endpoint_url
    values["s3"]["sessionTokenKey"] = ""  # SeaweedFS keys have no session token (the Secret has none)
    docs = _render(values, tmp_path)

    # 2. What the manifests say.
    ds = _one(docs, "DaemonSet")
    pod_spec = ds["spec"]["template"]["spec"]
    (daemon,) = [c for c in pod_spec["containers"] if c["name"] == "daemon"]
    test_pod = _one(docs, "Pod", lambda d: d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test")
    (selftest,) = test_pod["spec"]["containers"]
    config_volume = next(v for v in pod_spec["volumes"] if "configMap" in v)
    cm = _one(docs, "ConfigMap", lambda d: d["metadata"]["name"] == config_volume["configMap"]["name"])
    toml_text = cm["data"]["statestore.toml"]
    chart_cfg = tomllib.loads(toml_text)

    assert daemon["command"] == _dockerfile_exec_form("ENTRYPOINT"), "the chart's command is not the image's entrypoint"
    assert daemon["args"] == _dockerfile_exec_form("CMD")
    assert chart_cfg["s3_endpoint_url"] == seaweedfs.endpoint_url and chart_cfg["s3_addressing_style"] == "path"
    secret_name = values["s3"]["existingSecret"]
    # The Secret the operator would create, holding the SeaweedFS keys under the chart's key names.
    secrets = {secret_name: {values["s3"]["accessKeyIdKey"]: seaweedfs.access_key,
                             values["s3"]["secretAccessKeyKey"]: seaweedfs.secret_key}}
    daemon_env = resolve_env(daemon, secrets)
    assert {"STATESTORE_CONFIG", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(daemon_env)
    assert not any(k.startswith("STATESTORE_") and k != "STATESTORE_CONFIG" for k in daemon_env), \
        "settings must come from the ConfigMap only"
    sec = {**pod_spec.get("securityContext", {}), **daemon.get("securityContext", {})}
    uid, gid = int(sec["runAsUser"]), int(sec["runAsGroup"])
    test_sec = {**test_pod["spec"].get("securityContext", {}), **selftest.get("securityContext", {})}
    test_uid, test_gid = int(test_sec["runAsUser"]), int(test_sec["runAsGroup"])
    assert uid in chart_cfg["allowed_uids"] and test_uid in chart_cfg["allowed_uids"]

    nodes = {n: Node(n) for n in "AB"}
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    sockets: dict[str, str] = {}
    envs: dict[str, dict] = {}
    try:
        # 3. Start one daemon per node, exactly as the DaemonSet pod would.
        for name, node in nodes.items():
            mounts = node.pod_mounts("daemon", pod_spec, daemon)
            for init in pod_spec.get("initContainers", []):
                # prepare-host-dirs: chown uid:gid + chmod 2750 of the hostPath dirs. It runs as root in
                # the cluster; here as the mapped pod uid, who already owns the dirs (same end state).
                init_mounts = node.pod_mounts("daemon", pod_spec, init)
                argv = [rewrite(a, init_mounts) for a in init["command"] + init.get("args", [])]
                r = subprocess.run(as_user(uid, gid) + argv, env=image_env(None), capture_output=True,
                                   text=True, timeout=30)
                assert r.returncode == 0, f"init container {init['name']}: {r.stderr}"
                for d in argv[argv.index(init["name"]) + 1:]:
                    assert (os.stat(d).st_mode & 0o7777) == 0o2750, d
            # The ConfigMap volume: its keys as files, statestore.toml with ONLY the node-local paths moved.
            cm_dir = mounts[next(m["mountPath"] for m in daemon["volumeMounts"] if m["name"] == config_volume["name"])]
            node_toml = toml_text
            for key in NODE_LOCAL_KEYS:
                new = rewrite(chart_cfg[key], mounts)
                assert new != chart_cfg[key] or not chart_cfg[key], f"{key} = {chart_cfg[key]!r} is under no mount"
                node_toml, n = re.subn(rf"(?m)^{key} = .*$", lambda _m: f"{key} = {json.dumps(new)}", node_toml)
                assert n == 1, key
            node_cfg = tomllib.loads(node_toml)
            assert {k: v for k, v in node_cfg.items() if k not in NODE_LOCAL_KEYS} == \
                   {k: v for k, v in chart_cfg.items() if k not in NODE_LOCAL_KEYS}
            for k, v in cm["data"].items():
                (cm_dir / k).write_text(node_toml if k == "statestore.toml" else v)
            sockets[name] = node_cfg["socket"]
            assert len(os.fsencode(sockets[name])) <= 107
            assert Path(node_cfg["cache_dir"]).is_dir()

            env = envs[name] = {**image_env(mounts.get("/tmp")),
                                **{k: rewrite(v, mounts) for k, v in daemon_env.items()}}
            argv = exe(daemon["command"]) + [rewrite(a, mounts) for a in daemon["args"]]
            assert env["STATESTORE_CONFIG"] == str(cm_dir / "statestore.toml") in argv
            logs[name] = node.dir / "daemon.log"
            with open(logs[name], "wb") as log:
                procs[name] = subprocess.Popen(as_user(uid, gid) + argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True)

        # ...and wait for the readiness probe's exact command (run in the daemon container) to pass.
        probe = daemon["readinessProbe"]["exec"]["command"]
        for name, node in nodes.items():
            mounts = node.pod_mounts("daemon", pod_spec, daemon)
            argv = as_user(uid, gid) + exe([rewrite(a, mounts) for a in probe])
            assert sockets[name] in argv
            deadline = time.monotonic() + 30
            while True:
                code = procs[name].poll()
                assert code is None, f"daemon {name} exited {code}:\n{logs[name].read_text()}"
                r = subprocess.run(argv, env=envs[name], capture_output=True, text=True, timeout=30)
                if r.returncode == 0:
                    break
                assert time.monotonic() < deadline, f"daemon {name} never healthy: {r.stderr}\n{logs[name].read_text()}"
                time.sleep(0.2)

        # 4. `helm test` on each node: the test pod's exact command through that node's socket.
        s3 = _s3(seaweedfs)
        for name, node in nodes.items():
            mounts = node.pod_mounts("helm-test", test_pod["spec"], selftest)
            # kubelet fills the test pod's ConfigMap volume with the ConfigMap as rendered (the same
            # on every node; the selftest reads it for the S3 settings it cleans up with)
            test_volumes = {v["name"]: v for v in test_pod["spec"]["volumes"]}
            for m in selftest.get("volumeMounts", []):
                if "configMap" in test_volumes[m["name"]]:
                    for k, v in cm["data"].items():
                        (mounts[m["mountPath"].rstrip("/")] / k).write_text(v)
            argv = exe([rewrite(a, mounts) for a in selftest["command"] + selftest.get("args", [])])
            assert sockets[name] in argv and root in argv
            with Client(sockets[name]) as c:
                before = c.stats()
            r = subprocess.run(as_user(test_uid, test_gid) + argv, env={**image_env(mounts.get("/tmp")),
                               **{k: rewrite(v, mounts) for k, v in resolve_env(selftest, secrets).items()}},
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, f"helm test on node {name}: {r.stdout}{r.stderr}\n{logs[name].read_text()}"
            with Client(sockets[name]) as c:
                after = c.stats()
            ops_b, ops_a = before["daemon"]["requests_by_op"], after["daemon"]["requests_by_op"]
            for op in ("Open", "PutMany", "Commit", "GetMany", "AwaitDurable"):
                assert ops_a.get(op, 0) > ops_b.get(op, 0), (op, ops_b, ops_a)
            assert after["uploader"]["durable"] == before["uploader"]["durable"] + 1
            assert after["uploader"]["failed"] == 0
            # The scratch store in the bucket: its delta was uploaded under <root>/_selftest, and the
            # test pod (the daemon's config and credentials) deleted it again.
            m = re.search(r"served a round trip on (s3://\S+) \((\d+)_([0-9a-f]{32})\)", r.stdout)
            assert m, r.stdout
            store_uri, version, ckptid = m.group(1), int(m.group(2)), m.group(3)
            prefix = store_uri[len(f"s3://{bucket}/"):]
            assert prefix.startswith("ckpt/_selftest/selftest-") and version == 1
            key = f"{prefix}/{version}_{ckptid}.delta"
            assert "could not remove the scratch files" not in r.stderr, r.stderr
            assert not _exists(s3, bucket, key), (key, r.stderr)

        # 5. Node A commits two versions, is stopped (SIGTERM drains, exit 0); node B opens the same
        #    (version, ckptid) from S3 and reads the same data.
        sid = StoreId(root, "sim-op", 7)
        v1 = {f"k{i:05d}".encode(): f"value-{i}".encode() * 4 for i in range(3000)}
        with Client(sockets["A"]) as a:
            with a.open(sid, 0) as h:
                h.put_many(list(v1.items()))
                ref1 = h.commit()
            with a.open(sid, ref1.version, ref1.ckptid) as h:
                gone = [f"k{i:05d}".encode() for i in range(0, 3000, 7)]
                upd = {f"k{i:05d}".encode(): b"updated-%d" % i for i in range(1, 3000, 5)}
                h.remove_many(gone)
                h.put_many(list(upd.items()))
                ref2 = h.commit()
        expected = {**{k: v for k, v in v1.items() if k not in set(gone)}, **upd}  # removed, then put
        assert ref2.version == 2

        procs["A"].send_signal(signal.SIGTERM)
        rc = procs["A"].wait(chart_cfg["drain_timeout"] + 15)
        log_a = logs["A"].read_text()
        assert rc == 0, log_a
        assert "uploads drained: True" in log_a, log_a
        assert not os.path.lexists(sockets["A"]), "the stopped daemon left its socket behind"
        for ref in (ref1, ref2):
            assert _exists(s3, bucket, f"ckpt/{file_key(sid, ref, 'delta')}"), ref

        with Client(sockets["B"]) as b:
            loads_before = b.stats()["registry"]["loads"]
            with b.open(sid, ref2.version, ref2.ckptid) as h:
                assert h.ref == ref2
                assert h.get_many(list(v1)) == [expected.get(k) for k in v1]
                assert dict(h.scan()) == expected
                h.abort()
            assert b.stats()["registry"]["loads"] == loads_before + 1
    finally:
        # 6. Stop every daemon (SIGTERM, then kill), even on failure.
        codes = {name: _stop(p) for name, p in procs.items()}
        for node in nodes.values():
            shutil.rmtree(node.dir, ignore_errors=True)
    assert codes.get("B") == 0, codes
    assert time.monotonic() - t0 < 60
