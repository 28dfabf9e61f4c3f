"""ConfigMaps in the same input are read as the kubelet gives them: start scripts in ConfigMap
volumes are followed, ``envFrom`` and ``configMapKeyRef`` values are seen. A ConfigMap that is not
in the input stays unknown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.cli import main
from vramguard.policy import default_policy
from vramguard.workloads import object_parts, parts_demand, read_inputs

POLICY = default_policy()
OPTIONS = POLICY.demand_options()

START = """#!/bin/bash
set -e
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
exec vllm serve "$MODEL" --gpu-memory-utilization "$UTIL" --max-model-len 8192
"""


def config_map(name: str, data: dict[str, str], namespace: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def deployment(container: dict[str, Any], volumes: list[dict[str, Any]] | None = None,
               namespace: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "llm"}
    if namespace is not None:
        metadata["namespace"] = namespace
    base = {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
            "resources": {"limits": {"nvidia.com/gpu": 1}}}
    spec: dict[str, Any] = {"containers": [{**base, **container}]}
    if volumes:
        spec["volumes"] = volumes
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata,
            "spec": {"replicas": 1, "template": {"spec": spec}}}


SCRIPTS = [{"name": "scripts", "configMap": {"name": "vllm-start", "defaultMode": 0o755}}]
MOUNT = {"volumeMounts": [{"name": "scripts", "mountPath": "/scripts"}],
         "env": [{"name": "UTIL", "value": "0.45"}]}


def claim(objects: list[dict[str, Any]]) -> Any:
    parts = object_parts(objects[-1], POLICY.workload_kinds, inputs=read_inputs(objects))
    assert parts is not None
    [container] = parts_demand(parts, OPTIONS)[0].containers
    return container


@pytest.mark.parametrize(
    "command",
    [
        pytest.param({"command": ["/bin/bash", "/scripts/start.sh"]}, id="bash-FILE"),
        pytest.param({"command": ["/scripts/start.sh"]}, id="executed-by-its-shebang"),
        pytest.param({"command": ["sh", "-c", "/scripts/start.sh"]}, id="sh-c-runs-it"),
        pytest.param({"command": ["bash", "-c", "source /scripts/start.sh"]}, id="sourced"),
        pytest.param({"command": ["bash", "start.sh"], "workingDir": "/scripts"}, id="relative-to-workingDir"),
    ],
)
def test_a_start_script_in_a_config_map_volume_is_followed(command: dict[str, Any]) -> None:
    objects = [config_map("vllm-start", {"start.sh": START}), deployment({**MOUNT, **command}, SCRIPTS)]
    container = claim(objects)
    assert container.engine == "vllm" and float(container.claim.fraction) == 0.45
    # Without the ConfigMap, the script is a program nobody can read.
    alone = claim(objects[1:])
    assert alone.engine is None and alone.claim is None


def test_a_sub_path_mount_and_items_place_the_file_where_the_kubelet_does() -> None:
    volumes = [{"name": "scripts", "configMap": {"name": "vllm-start",
                                                 "items": [{"key": "start.sh", "path": "bin/run"}]}}]
    container = {"command": ["bash", "/opt/run.sh"], "env": MOUNT["env"],
                 "volumeMounts": [{"name": "scripts", "mountPath": "/opt/run.sh", "subPath": "bin/run"}]}
    assert claim([config_map("vllm-start", {"start.sh": START}), deployment(container, volumes)]).claim is not None
    # A projected volume's ConfigMap sources too.
    projected = [{"name": "scripts", "projected": {"sources": [{"configMap": {"name": "vllm-start"}}]}}]
    found = claim([config_map("vllm-start", {"start.sh": START}),
                   deployment({**MOUNT, "command": ["bash", "/scripts/start.sh"]}, projected)])
    assert float(found.claim.fraction) == 0.45


def test_a_python_script_is_not_read_as_a_shell_script() -> None:
    objects = [config_map("vllm-start", {"start.sh": "#!/usr/bin/env python3\nimport os\n"}),
               deployment({**MOUNT, "command": ["/scripts/start.sh"]}, SCRIPTS)]
    assert claim(objects).engine is None


def test_env_from_and_key_refs_of_known_config_maps_are_read_and_env_wins() -> None:
    settings = config_map("vllm-settings", {"VLLM_UTIL": "0.6", "UTIL": "0.2", "not a name": "x"})
    container = {
        "envFrom": [{"configMapRef": {"name": "vllm-settings"}}],
        "env": [{"name": "UTIL", "valueFrom": {"configMapKeyRef": {"name": "vllm-settings", "key": "VLLM_UTIL"}}}],
        "command": ["sh", "-c", 'vllm serve m --gpu-memory-utilization "$UTIL"'],
    }
    found = claim([settings, deployment(container)])
    assert float(found.claim.fraction) == 0.6  # env's UTIL (from the key) over envFrom's UTIL
    prefixed = {"envFrom": [{"prefix": "APP_", "configMapRef": {"name": "vllm-settings"}}],
                "command": ["sh", "-c", 'vllm serve m --gpu-memory-utilization "$APP_UTIL"']}
    assert float(claim([settings, deployment(prefixed)]).claim.fraction) == 0.2


def test_a_config_map_of_another_namespace_is_not_used() -> None:
    container = {"envFrom": [{"configMapRef": {"name": "vllm-settings"}}],
                 "command": ["sh", "-c", 'vllm serve m --gpu-memory-utilization "$UTIL"']}
    objects = [config_map("vllm-settings", {"UTIL": "0.2"}, namespace="other"), deployment(container, namespace="ml")]
    found = claim(objects)
    assert found.claim is None and any("cannot read it" in w for w in found.warnings)


def test_explain_reads_a_directory_with_the_workload_and_its_config_map(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "configmap.yaml").write_text(yaml.safe_dump(config_map("vllm-start", {"start.sh": START})))
    (tmp_path / "deployment.yaml").write_text(
        yaml.safe_dump(deployment({**MOUNT, "command": ["/bin/bash", "/scripts/start.sh"]}, SCRIPTS)))
    assert main(["explain", "-o", "json", str(tmp_path)]) == 0
    reports = json.loads(capsys.readouterr().out)
    [report] = [r for r in reports if r["kind"] == "Deployment"]
    [container] = report["containers"]
    assert container["engine"] == "vllm" and container["vram_fraction_per_gpu"] == 0.45
