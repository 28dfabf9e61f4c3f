"""Serving operators' kinds read as the pods their controllers make: the fields that change the GPUs
and the engine's settings, what is assumed (said in a note), and malformed objects read without
raising. The published examples are in the workload corpus (test_workload_corpus.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.cli import main
from vramguard.operators import OPERATOR_KINDS
from vramguard.operators.common import MAX_REPLICAS
from vramguard.policy import Policy, default_policy
from vramguard.template_part import TemplatePart
from vramguard.workloads import Inputs, object_parts, parts_demand, read_inputs

POLICY = default_policy()
OPTIONS = POLICY.demand_options()


def parts(obj: dict[str, Any], objects: list[dict[str, Any]] | None = None,
          policy: Policy = POLICY) -> tuple[list[TemplatePart], list[str]]:
    notes: list[str] = []
    found = object_parts(obj, policy.workload_kinds, inputs=read_inputs([*(objects or []), obj]), notes=notes)
    assert found is not None
    return found, notes


def containers(obj: dict[str, Any], objects: list[dict[str, Any]] | None = None) -> list[tuple[Any, ...]]:
    found, _ = parts(obj, objects)
    return [
        (part.name, part.pods, c.name, c.resource, c.gpus, c.engine,
         float(c.claim.fraction) if c.claim is not None and c.claim.fraction is not None else None)
        for part, demand in zip(found, parts_demand(found, OPTIONS), strict=True)
        for c in demand.containers
    ]


def model(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kubeai.org/v1", "kind": "Model", "metadata": {"name": "m"},
            "spec": {"url": "hf://org/m", "engine": "VLLM", **spec}}


def test_kubeai_profile_multiplies_the_gpus_and_args_reach_vllm() -> None:
    found = containers(model(resourceProfile="nvidia-gpu-h100:4", maxReplicas=3,
                             args=["--gpu-memory-utilization=0.5", "--tensor-parallel-size=4"]))
    assert found == [("model", 3, "server", "nvidia.com/gpu", 4, "vllm", 0.5)]
    assert containers(model(resourceProfile="cpu:2")) == []  # no GPU
    # OLlama's VRAM is not known; AMD's profile names AMD's resource (not one of the policy's).
    [(_, _, _, _, _, engine, _)] = containers(model(engine="OLlama", resourceProfile="nvidia-gpu-l4:1"))
    assert engine is None


def test_kubeai_profiles_it_does_not_know_are_said() -> None:
    _, notes = parts(model(resourceProfile="my-gpu-h200:2"))
    assert notes == ["resourceProfile my-gpu-h200 is not one of KubeAI's chart profiles: counted as 2 "
                     "nvidia.com/gpu (as the chart's GPU profiles give one per unit)"]
    _, notes = parts(model(resourceProfile="nvidia-gpu-l4"))
    assert notes == ["resourceProfile 'nvidia-gpu-l4' is not <profile>:<count>: KubeAI refuses the Model"]


def workspace(instance: str = "Standard_NC96ads_A100_v4", **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "kaito.sh/v1beta1", "kind": "Workspace", "metadata": {"name": "ws", "namespace": "ml"},
            "resource": {"instanceType": instance}, "inference": {"preset": {"name": "phi-4"}}, **extra}


def test_kaito_instance_type_gives_the_gpus_and_the_operator_utilization() -> None:
    assert containers(workspace()) == [("workspace", 1, "ws", "nvidia.com/gpu", 4, "vllm", 0.84)]
    # Case-insensitive, as KAITO compares them; an A10 gets 0.82.
    assert containers(workspace("standard_nv36ads_a10_v5"))[0][4:] == (1, "vllm", 0.82)
    # A MIG partition asks for the profile's instances.
    partitioned = workspace("Standard_NC24ads_A100_v4")
    partitioned["resource"]["partition"] = {"mode": "mig", "profile": "1g.10gb", "count": 2}
    assert containers(partitioned)[0][3:5] == ("nvidia.com/mig-1g.10gb", 2)


def test_kaito_config_map_overrides_and_a_missing_one_is_said() -> None:
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "params", "namespace": "ml"},
              "data": {"inference_config.yaml": "vllm:\n  gpu-memory-utilization: 0.6\n  enforce-eager: true\n"}}
    ws = workspace(inference={"preset": {"name": "phi-4"}, "config": "params"})
    assert containers(ws, [config])[0][-1] == 0.6
    _, notes = parts(ws)
    assert notes == ["inference.config names ConfigMap params, not in the input: its vllm settings "
                     "(gpu-memory-utilization among them) override KAITO's; pass it too"]
    broken = {**config, "data": {"inference_config.yaml": "vllm: [unclosed"}}
    _, notes = parts(ws, [broken])
    assert notes and "is not YAML" in notes[0]


def test_kaito_unknown_instance_type_is_said_and_runs_nothing_counted() -> None:
    found, notes = parts(workspace("Standard_Unknown_v9"))
    assert found == [] and "is not a SKU KAITO's table names" in notes[0]


def test_kaito_several_nodes_run_one_engine_across_them() -> None:
    ws = workspace("Standard_NC48ads_A100_v4", status={"targetNodeCount": 3})
    found, _ = parts(ws)
    [demand] = parts_demand(found, OPTIONS)
    assert found[0].pods == 3 and found[0].group_size == 3 and not demand.errors


def nim(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "apps.nvidia.com/v1alpha1", "kind": "NIMService", "metadata": {"name": "llm"},
            "spec": {"image": {"repository": "nvcr.io/nim/meta/llama", "tag": "1.8"}, **spec}}


def test_nim_replicas_scale_and_args() -> None:
    service = nim(scale={"enabled": True, "hpa": {"minReplicas": 1, "maxReplicas": 4}},
                  resources={"limits": {"nvidia.com/gpu": 2}},
                  args=["--gpu-memory-utilization", "0.5"])
    assert [(c[1], c[2], c[4]) for c in containers(service)] == [(4, "llm-ctr", 2)]
    _, notes = parts(nim())
    assert notes and "names no GPU" in notes[0]


def test_nim_dra_resources_become_the_pods_claims() -> None:
    found, notes = parts(nim(draResources=[{"resourceClaimTemplateName": "gpu-claim"}]))
    spec = found[0].template["spec"]
    assert spec["resourceClaims"] == [{"name": "claim-0", "resourceClaimTemplateName": "gpu-claim"}]
    assert spec["containers"][0]["resources"]["claims"] == [{"name": "claim-0"}]
    assert notes == []


def graph(services: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoGraphDeployment", "metadata": {"name": "g"},
            "spec": {"services": services, **spec}}


def worker(**service: Any) -> dict[str, Any]:
    main = {"image": "nvcr.io/nvidia/ai-dynamo/vllm-runtime:0.4.0", "command": ["python3", "-m", "dynamo.vllm"],
            "args": ["--model", "Qwen/Qwen3-0.6B", "--gpu-memory-utilization", "0.4"]}
    return {"componentType": "worker", "replicas": 2, "extraPodSpec": {"mainContainer": main}, **service}


def test_dynamo_gpu_count_type_requests_and_autoscaling() -> None:
    assert containers(graph({"w": worker(resources={"limits": {"gpu": "2"}})})) == [
        ("w", 2, "main", "nvidia.com/gpu", 2, "vllm", 0.4)]
    # requests.gpu alone (newer operators turn it into a request), and gpuType naming the resource.
    typed = worker(resources={"requests": {"gpu": "1", "gpuType": "nvidia.com/mig-3g.40gb"}},
                   autoscaling={"enabled": True, "maxReplicas": 5})
    assert containers(graph({"w": typed}))[0][:5] == ("w", 5, "main", "nvidia.com/mig-3g.40gb", 1)


def test_dynamo_service_env_wins_over_the_graph_env() -> None:
    service = worker(resources={"limits": {"gpu": "1"}}, envs=[{"name": "UTIL", "value": "0.3"}])
    service["extraPodSpec"]["mainContainer"]["args"] = ["--gpu-memory-utilization", "$(UTIL)"]
    found = containers(graph({"w": service}, envs=[{"name": "UTIL", "value": "0.9"}]))
    assert found[0][-1] == 0.3


def test_dynamo_v1beta1_components_carry_pod_templates() -> None:
    template = {"spec": {"containers": [{"name": "main", "image": "vllm/vllm-openai:v0.11.0",
                                         "command": ["vllm", "serve", "m", "--gpu-memory-utilization", "0.5"],
                                         "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    obj = {"apiVersion": "nvidia.com/v1beta1", "kind": "DynamoGraphDeployment", "metadata": {"name": "g"},
           "spec": {"components": [{"name": "decode", "replicas": 3, "podTemplate": template}]}}
    assert containers(obj) == [("decode", 3, "main", "nvidia.com/gpu", 1, "vllm", 0.5)]


def test_a_workload_kinds_entry_for_the_same_kind_wins_over_the_reader() -> None:
    base = yaml.safe_load(Path("vramguard/default_policy.yaml").read_text())
    base["workload_kinds"] = [{"group": "kubeai.org", "kind": "Model", "resource": "models", "versions": ["v1"],
                               "templates": [{"name": "own", "path": "spec.podTemplate"}]}]
    policy = Policy.from_yaml(yaml.safe_dump(base))
    found, _ = parts({**model(resourceProfile="nvidia-gpu-l4:1"), "spec": {"podTemplate": {"spec": {}}}}, policy=policy)
    assert [p.name for p in found] == ["own"]


def _junk(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(8 if depth < 4 else 5)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, -1, 0, 3, 10**12, 0.5])
    if choice == 2:
        return rng.choice(["", "gpu", "nvidia-gpu-l4:x", "a:b:c", "1" * 20, "Standard_NC24ads_A100_v4"])
    if choice in (3, 4):
        return rng.choice([[], {}, "x"])
    if choice == 5:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = ["spec", "resource", "inference", "services", "components", "resourceProfile", "replicas", "maxReplicas",
            "args", "env", "envs", "resources", "limits", "gpu", "gpuType", "multiNode", "parallelism", "pipeline",
            "extraPodSpec", "mainContainer", "deploymentConfig", "vllmConfig", "draResources", "config", "image",
            "instanceType", "partition", "scale", "hpa", "autoscaling", "multinode", "nodeCount", "podTemplate"]
    return {rng.choice(keys): _junk(rng, depth + 1) for _ in range(rng.randrange(5))}


@pytest.mark.parametrize("seed", range(300))
def test_malformed_operator_objects_never_raise(seed: int) -> None:
    rng = random.Random(seed)
    (group, kind) = rng.choice(sorted(OPERATOR_KINDS))
    fields = _junk(rng)
    obj = {"apiVersion": f"{group}/v1", "kind": kind, "metadata": {"name": "x"},
           **(fields if isinstance(fields, dict) else {})}
    if rng.random() < 0.5:
        obj["spec"] = _junk(rng)
    notes: list[str] = []
    found = object_parts(obj, POLICY.workload_kinds, inputs=Inputs({}, {}), notes=notes)
    assert found is not None
    parts_demand(found, OPTIONS)
    assert all(isinstance(n, str) for n in notes)


def test_explain_shows_an_operator_kind_and_its_notes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(model(resourceProfile="my-gpu:1", args=["--gpu-memory-utilization=0.5"])))
    assert main(["explain", "-o", "json", str(path)]) == 0
    [report] = json.loads(capsys.readouterr().out)
    assert report["templates"] == [{"name": "model", "pods": 1, "gpu": True}]
    assert report["containers"][0]["engine"] == "vllm" and not report["skipped"]
    assert any("is not one of KubeAI's chart profiles" in w for w in report["warnings"])


def ray_service(serve_config: Any, gpus: int = 2) -> dict[str, Any]:
    worker = {"name": "ray-worker", "image": "rayproject/ray-llm:2.52.0-py311-cu128",
              "resources": {"limits": {"nvidia.com/gpu": gpus}}}
    return {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "llm"},
            "spec": {"serveConfigV2": serve_config if isinstance(serve_config, str) else yaml.safe_dump(serve_config),
                     "rayClusterConfig": {"headGroupSpec": {"template": {"spec": {"containers": [
                         {"name": "ray-head", "image": "rayproject/ray-llm:2.52.0-py311-cu128"}]}}},
                         "workerGroupSpecs": [{"groupName": "gpu", "replicas": 1,
                                               "template": {"spec": {"containers": [worker]}}}]}}}


def llm_app(name: str = "llms", **kwargs: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"model_loading_config": {"model_id": "m"}, "engine_kwargs": kwargs}
    return {"name": name, "import_path": "ray.serve.llm:build_openai_app", "args": {"llm_configs": [config]}}


def test_ray_serve_llm_settings_reach_the_gpu_workers_the_largest_winning() -> None:
    service = ray_service({"applications": [llm_app("a", gpu_memory_utilization=0.4),
                                            llm_app("b", gpu_memory_utilization=0.6, tensor_parallel_size=2)]})
    [worker] = containers(service)
    assert worker[2:] == ("ray-worker", "nvidia.com/gpu", 2, "vllm", 0.6)
    # Without the setting, vLLM's default: for an image that names no vLLM version, the whole device.
    [worker] = containers(ray_service({"applications": [llm_app()]}))
    assert worker[-1] == 1.0


def test_ray_serve_configs_vramguard_cannot_read_leave_the_workers_unknown() -> None:
    for config, note in (
        ("applications: [{args: {llm_configs: [unclosed", "serveConfigV2 is not YAML"),
        ({"applications": [{**llm_app(gpu_memory_utilization=0.5),
                            "args": {"llm_configs": [{"engine_kwargs": {"gpu_memory_utilization": 0.5},
                                                      "placement_group_config": {"bundles": [{"GPU": 0.5}]}}]}}]},
         "fractional GPU bundles"),
    ):
        _, notes = parts(ray_service(config))
        [(_, _, _, _, _, engine, _)] = containers(ray_service(config))
        assert engine is None and any(note in n for n in notes)
    # An application of its own (not Ray Serve LLM) is not read either.
    custom = {"applications": [{"name": "x", "import_path": "serve:model", "args": {"llm_configs": []}}]}
    assert containers(ray_service(custom))[0][5] is None


def test_ray_serve_runtime_env_is_the_engines_environment() -> None:
    app = llm_app(gpu_memory_utilization=0.5)
    app["args"]["llm_configs"][0]["runtime_env"] = {"env_vars": {"VLLM_USE_V1": "1"}}
    found, _ = parts(ray_service({"applications": [app]}))
    [worker] = found[1].template["spec"]["containers"]
    assert {"name": "VLLM_USE_V1", "value": "1"} in worker["env"]


def test_a_ray_serve_setting_that_is_no_number_is_vllms_error_not_a_crash() -> None:
    found, _ = parts(ray_service({"applications": [llm_app(gpu_memory_utilization="high"),
                                                   llm_app("b", gpu_memory_utilization=0.3)]}))
    [demand] = [d for d in parts_demand(found, OPTIONS) if d.containers]
    assert demand.errors == ("container ray-worker: --gpu-memory-utilization high is not a number",)


def test_pods_are_capped_however_large_the_counts() -> None:
    huge = nim(replicas=10**6, multiNode={"parallelism": {"pipeline": 10**6}},
               resources={"limits": {"nvidia.com/gpu": 1}})
    found, _ = parts(huge)
    assert [p.pods for p in found] == [10**6, MAX_REPLICAS]
    graph_parts, _ = parts(graph({"w": worker(replicas="9999999", multinode={"nodeCount": 10**6},
                                             resources={"limits": {"gpu": "1"}})}))
    assert graph_parts[0].pods == MAX_REPLICAS


def test_a_hostile_serve_config_is_bounded() -> None:
    # The webhook reads RayServices too: aliases repeating one list, and sheer size, stay cheap.
    many = "x: &c [" + ", ".join(["{engine_kwargs: {gpu_memory_utilization: 0.5}}"] * 9) + "]\n"
    many += "applications: [" + ", ".join(
        ["{import_path: 'ray.serve.llm:build_openai_app', args: {llm_configs: *c}}"] * 60) + "]\n"
    _, notes = parts(ray_service(many))
    assert notes == ["serveConfigV2 has over 64 LLM configs: not read; declare the workers' VRAM"]
    _, notes = parts(ray_service("llm_configs: " + "x" * (70 << 10)))
    assert notes == ["serveConfigV2 is over 64 KiB: not read; declare the workers' VRAM"]
