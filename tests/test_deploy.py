"""deploy/: the Dockerfile and the Kubernetes manifests agree with the code's defaults.

No Docker engine or cluster here: these checks parse the files (PyYAML, a test-only dependency) and
compare ports, paths, probe endpoints, the user and the shipped config with what the code does.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.config import SupervisorConfig, config_dict_to_fields, load_config
from supervisor.prometheus import DEFAULT_METRICS_PORT, HEALTHZ_PATH, METRICS_PATH, READYZ_PATH, parse_metrics_addr

pytestmark = pytest.mark.timeout(30)

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _docs() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict) and doc.get("kind"), path
            out[doc["kind"]] = doc
    return out


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _container(ds: dict[str, Any]) -> dict[str, Any]:
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


def _shipped_config(docs: dict[str, dict[str, Any]]) -> SupervisorConfig:
    text = docs["ConfigMap"]["data"]["tenants.toml"]
    return load_config(overrides=config_dict_to_fields(tomllib.loads(text), "deploy/k8s/configmap.yaml"), environ={})


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files


def test_shipped_config_is_valid_and_serves_metrics_on_the_container_port() -> None:
    docs = _docs()
    config = _shipped_config(docs)  # unknown keys or bad values raise here
    host, port = parse_metrics_addr(str(config.metrics_addr))
    assert host == "0.0.0.0" and port == DEFAULT_METRICS_PORT  # the pod IP, for kubelet and Prometheus
    c = _container(docs["DaemonSet"])
    (metrics_port,) = [p for p in c["ports"] if p["name"] == "metrics"]
    assert metrics_port["containerPort"] == DEFAULT_METRICS_PORT
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert config.run_dir == mounts["run"]
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    assert env.get("TWT_RUN_DIR", config.run_dir) == config.run_dir
    args = c["args"]
    assert args[0] == "supervise" and args[args.index("--config") + 1] == f"{mounts['config']}/tenants.toml"
    # the file name the container reads is the ConfigMap's key
    assert "tenants.toml" in docs["ConfigMap"]["data"]


def test_probes_use_the_health_endpoints_and_fit_a_slow_snapshot() -> None:
    c = _container(_docs()["DaemonSet"])
    for probe, path in (("startupProbe", HEALTHZ_PATH), ("livenessProbe", HEALTHZ_PATH), ("readinessProbe", READYZ_PATH)):
        get = c[probe]["httpGet"]
        assert (get["path"], get["port"]) == (path, "metrics"), probe
        # a probe waits up to 1 s for the loop's fresh snapshot: leave room
        assert c[probe]["timeoutSeconds"] >= 2, probe


def test_daemonset_gpu_user_volumes_and_grace() -> None:
    docs = _docs()
    ds = docs["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    c = _container(ds)
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert set(mounts) == set(volumes)
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"] == "/dev/shm"
    assert mounts["tmp"] == "/tmp"  # the root filesystem is read-only
    keys = volumes["keys"]["secret"]
    assert keys["secretName"] == "twt-keys" and keys["defaultMode"] == 0o400
    # the init container hands the run and state directories to the supervisor's user, 0700
    (init,) = spec["initContainers"]
    script = init["command"][-1]
    assert f"chown {sc['runAsUser']}:{sc['runAsGroup']} {mounts['run']} {mounts['state']}" in script
    assert f"chmod 0700 {mounts['run']} {mounts['state']}" in script
    config = _shipped_config(docs)
    need = config.stop_timeout_s + 2 * config.kill_grace_s + 5
    assert spec["terminationGracePeriodSeconds"] > need
    # the pods the PodMonitor selects are these, on the named port and the code's path
    pm = docs["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", METRICS_PATH)
    assert ds["metadata"]["namespace"] == pm["metadata"]["namespace"] == docs["Namespace"]["metadata"]["name"]


def test_dockerfile_stages_user_volumes_and_port() -> None:
    steps = _dockerfile()
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) == 2 and all("-slim" in f for f in froms)  # slim base, a separate build stage
    assert froms[0].endswith(" AS build")
    build_end = [i for i, (w, _) in enumerate(steps) if w == "FROM"][1]
    assert any("gcc" in a for w, a in steps[:build_end] if w == "RUN")  # the extension is compiled there
    assert not any("gcc" in a for w, a in steps[build_end:] if w == "RUN")  # and no compiler ships
    assert any(w == "COPY" and a.startswith("--from=build ") for w, a in steps[build_end:])
    (user,) = [a for w, a in steps if w == "USER"]
    uid = user.split(":")[0]
    assert uid not in ("0", "root")
    ds_user = _container(_docs()["DaemonSet"])["securityContext"]["runAsUser"]
    assert int(uid) == ds_user
    (volume,) = [a for w, a in steps if w == "VOLUME"]
    volumes = set(yaml.safe_load(volume))  # the JSON form
    env = " ".join(a for w, a in steps if w == "ENV")
    run_dir = re.search(r"TWT_RUN_DIR=(\S+)", env)
    assert run_dir is not None and run_dir.group(1) in volumes and "/var/lib/twt" in volumes
    (expose,) = [a for w, a in steps if w == "EXPOSE"]
    assert int(expose) == DEFAULT_METRICS_PORT
    (health,) = [a for w, a in steps if w == "HEALTHCHECK"]
    assert f"127.0.0.1:{DEFAULT_METRICS_PORT}{HEALTHZ_PATH}" in health
    (cmd,) = [a for w, a in steps if w == "CMD"]
    argv = yaml.safe_load(cmd)
    assert argv[0] == "supervise" and argv[argv.index("--metrics-addr") + 1] == f"0.0.0.0:{DEFAULT_METRICS_PORT}"
    assert [yaml.safe_load(a) for w, a in steps if w == "ENTRYPOINT"] == [["twt"]]
