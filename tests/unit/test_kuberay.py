"""KubeRay manifests: valid against the RayService CRD, in sync with the Serve config, and shaped for B200 TP=4."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.settings import AppSettings

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayservices.yaml"
MANIFESTS = sorted((ROOT / "kuberay").glob("*.yaml"))
SERVE_CONFIG = ROOT / "deployments" / "b200-tp4.yaml"


def _load_generator():
    spec = importlib.util.spec_from_file_location("kuberay_generate", ROOT / "kuberay" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def crd_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = v1["schema"]["openAPIV3Schema"]
    # Kubernetes' structural schemas prune unknown fields; a manifest here must not rely on that, so unknown
    # fields are an error (a typo in a field name would otherwise be silently dropped by the API server).
    return jsonschema.Draft7Validator(_closed(schema))


def _closed(schema):
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            if not schema.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in MANIFESTS}


def test_there_are_manifests_for_4_and_8_gpu_pods(manifests):
    assert set(manifests) == {"rayservice-b200-tp4.yaml", "rayservice-b200-2x-tp4.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_the_kuberay_crd(path, crd_validator):
    doc = yaml.safe_load(path.read_text())
    errors = sorted(crd_validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:10])


def test_crd_validation_catches_a_wrong_field(manifests, crd_validator):
    """The schema check has teeth: a misspelt field and a wrong type are both rejected."""
    doc = copy.deepcopy(manifests["rayservice-b200-tp4.yaml"])
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["maxReplica"] = 3
    assert any("maxReplica" in e.message for e in crd_validator.iter_errors(doc))
    doc = copy.deepcopy(manifests["rayservice-b200-tp4.yaml"])
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["minReplicas"] = "1"
    assert list(crd_validator.iter_errors(doc))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_embedded_serve_config_is_valid_for_serve_and_the_app(path):
    doc = yaml.safe_load(path.read_text())
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_cfg)
    AppSettings.model_validate(serve_cfg["applications"][0]["args"])


def test_generated_manifests_are_up_to_date():
    assert _load_generator().main(["--check"]) == 0, "run: python kuberay/generate.py"


def test_serve_config_is_embedded_unchanged_except_the_declared_overrides(manifests):
    gen = _load_generator()
    source = yaml.safe_load(SERVE_CONFIG.read_text())
    for filename, variant in gen.VARIANTS.items():
        embedded = yaml.safe_load(manifests[filename]["spec"]["serveConfigV2"])
        expected = copy.deepcopy(source)
        for model in expected["applications"][0]["args"]["models"]:
            model["deployment"]["autoscaling_config"].update(variant["engine_autoscaling"])
        assert json.dumps(embedded, sort_keys=True) == json.dumps(expected, sort_keys=True), filename


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_cluster_shape_cpu_head_b200_workers_autoscaler_v2(path):
    doc = yaml.safe_load(path.read_text())
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["version"] == "v2"

    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (head_c,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_c["resources"]["limits"]

    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    model_dep = serve_cfg["applications"][0]["args"]["models"][0]["deployment"]
    gpus_per_replica = sum(b.get("GPU", 0) for b in model_dep["placement_group_bundles"])
    (gpu_group,) = [g for g in cluster["workerGroupSpecs"] if "nvidia.com/gpu" in
                    g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    spec = gpu_group["template"]["spec"]
    (c,) = spec["containers"]
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus in (4, 8) and gpus % gpus_per_replica == 0
    assert gpu_group["rayStartParams"]["num-gpus"] == str(gpus)
    assert "accelerator_type:B200" in gpu_group["rayStartParams"]["resources"]
    # Enough pods for the most engine replicas Serve may ask for, and a floor that holds the minimum.
    per_pod = gpus // gpus_per_replica
    auto = model_dep["autoscaling_config"]
    assert gpu_group["maxReplicas"] * per_pod >= auto["max_replicas"]
    assert gpu_group["minReplicas"] * per_pod >= auto["min_replicas"]
    assert gpu_group["minReplicas"] * per_pod < auto["min_replicas"] + per_pod  # no idle pod at the floor
    # /dev/shm is memory-backed and mounted; the GPU taint is tolerated.
    shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    # The pod outlives Serve's graceful shutdown of its replicas.
    assert spec["terminationGracePeriodSeconds"] > model_dep["graceful_shutdown_timeout_s"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_ray_container_gets_the_server_key_ring_from_a_secret(path):
    cluster = yaml.safe_load(path.read_text())["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for c in group["template"]["spec"]["containers"]:
            (env,) = [e for e in c["env"] if e["name"] == "SERVE_APP_SERVER_SECRET"]
            ref = env["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "serve-app-server-secret" and not ref.get("optional")
    # ...and the Serve config leaves the key to it: no secret in the manifest itself.
    serve_cfg = yaml.safe_load(yaml.safe_load(path.read_text())["spec"]["serveConfigV2"])
    assert "server_secret" not in serve_cfg["applications"][0]["args"].get("ingress", {})
