"""KubeRay manifests: valid against the RayService CRD, in sync with the Serve configs, and sized for B200 nodes."""

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


def test_there_are_manifests_for_4_and_8_gpu_pods_and_the_coding_models(manifests):
    expected = {"rayservice-b200-tp4.yaml", "rayservice-b200-2x-tp4.yaml", "rayservice-b200-coding-models.yaml"}
    assert set(manifests) == expected
    gen = _load_generator()
    assert set(gen.VARIANTS) == expected
    # Both B200 Serve configs have a RayService.
    assert {v["serve_config"] for v in gen.VARIANTS.values()} == {
        "deployments/b200-tp4.yaml", "deployments/b200-coding-models.yaml"}


@pytest.mark.parametrize(("groups", "nodes"), [
    ([8, 4, 4, 1, 1], 3),  # the coding models' floor: Kimi alone, Qwen3-Coder + GLM, the gpt-oss pair
    ([4, 4], 1),
    ([4], 1),
    ([], 0),
    ([6, 6, 4], 3),  # 16 GPUs but STRICT_PACK groups do not split: sum / 8 would say 2
    ([1] * 9, 2),
    ([8, 8, 4, 4, 4, 4, 4, 4, 4, 4] + [1] * 8, 7),  # the coding models' ceiling
])
def test_pack_places_every_group_whole_on_one_node(groups, nodes):
    packed = _load_generator().pack(groups, 8)
    assert len(packed) == nodes
    assert sorted(g for node in packed for g in node) == sorted(groups)  # every group placed, once
    assert all(sum(node) <= 8 for node in packed)


def test_pack_refuses_a_group_larger_than_a_node():
    with pytest.raises(ValueError, match="cannot fit"):
        _load_generator().pack([4, 9], 8)


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
    for filename, variant in gen.VARIANTS.items():
        embedded = yaml.safe_load(manifests[filename]["spec"]["serveConfigV2"])
        expected = yaml.safe_load((ROOT / variant["serve_config"]).read_text())
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
    model_deps = [m["deployment"] for m in serve_cfg["applications"][0]["args"]["models"]]
    (gpu_group,) = [g for g in cluster["workerGroupSpecs"] if "nvidia.com/gpu" in
                    g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    spec = gpu_group["template"]["spec"]
    (c,) = spec["containers"]
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus in (4, 8)
    assert gpu_group["rayStartParams"]["num-gpus"] == str(gpus)
    assert "accelerator_type:B200" in gpu_group["rayStartParams"]["resources"]
    floor, ceiling = [], []  # every engine replica's placement group (its GPUs) at min_replicas / max_replicas
    for dep in model_deps:
        gpus_per_replica = sum(b.get("GPU", 0) for b in dep["placement_group_bundles"])
        assert dep["placement_group_strategy"] == "STRICT_PACK"
        assert gpus % gpus_per_replica == 0  # a replica's group fits a pod, and replicas tile it
        # A fixed size (autoscaling_config null) is num_replicas at both ends.
        fixed = dep.get("num_replicas")
        auto = dep.get("autoscaling_config") or {"min_replicas": fixed, "max_replicas": fixed}
        floor += [gpus_per_replica] * auto["min_replicas"]
        ceiling += [gpus_per_replica] * auto["max_replicas"]
    # Enough pods for the most engine replicas Serve may ask for, and a floor that holds the minimum: as many pods
    # as the groups packed whole onto pods (STRICT_PACK), with no pod to spare at the floor; at the ceiling one
    # spare where groups of different sizes can fragment the pods (generate.gpu_pods), else none.
    gen = _load_generator()
    spare = gen.FRAGMENTATION_SPARE_PODS if len(set(ceiling)) > 1 else 0
    assert gpu_group["minReplicas"] == gpu_group["replicas"] == len(gen.pack(floor, gpus))
    assert gpu_group["maxReplicas"] == len(gen.pack(ceiling, gpus)) + spare
    assert gpu_group["maxReplicas"] * gpus >= sum(ceiling)
    assert gpu_group["minReplicas"] * gpus >= sum(floor)
    assert (gpu_group["minReplicas"] - 1) * gpus < sum(floor)  # no idle pod at the floor
    assert (gpu_group["maxReplicas"] - 1 - spare) * gpus < sum(ceiling)  # none past the ceiling but the spare
    # /dev/shm is memory-backed and mounted; the GPU taint is tolerated.
    shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    # The pod outlives Serve's graceful shutdown of its replicas.
    assert spec["terminationGracePeriodSeconds"] > max(d["graceful_shutdown_timeout_s"] for d in model_deps)


def test_coding_models_cluster_fits_every_engine_floor_and_ceiling(manifests):
    """8-GPU pods. Floor: Kimi-K2 (TP=8) takes a pod, Qwen3-Coder + GLM-4.6 (TP=4 each) share one, the two gpt-oss
    replicas (TP=1) need a third. Ceiling: 2 Kimi pods, 4 pods of 4 + 4 TP=4 replicas, 8 gpt-oss on one pod, and
    one spare for the fragmentation mixed group sizes can cause."""
    cluster = manifests["rayservice-b200-coding-models.yaml"]["spec"]["rayClusterConfig"]
    (gpu_group,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"].startswith("b200")]
    assert gpu_group["rayStartParams"]["num-gpus"] == "8"
    assert (gpu_group["minReplicas"], gpu_group["maxReplicas"]) == (3, 8)


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
