"""HAMi's scheduler extender as the throughput benchmark's peer (``bench.hami``): the node
annotations its device plugin would leave, what the waves' pods ask it for, the second scheduler's
configuration as its chart writes it, and the launcher that starts it with the harness's command
line. No network beyond loopback, no Go, no HAMi."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from bench.extender import (
    HAMI_LAUNCHER,
    HAMI_LOG_LINES,
    WAVE_UTILIZATION,
    _hami_nodes_and_pods,
    hami_log_counts,
    process_memory,
    summary_table,
    verb_figures,
    wave_pod,
)
from bench.hami import launch, peer
from e2e import services
from e2e.procs import free_ports

H100_MIB = 81559


# --------------------------------------------------------------------------- nodes


def test_register_annotation_is_hami_device_info_json() -> None:
    value = peer.register_annotation("bench-gpu-0001", gpus=2, count=4, devmem_mib=H100_MIB,
                                     product="NVIDIA H100 80GB HBM3")
    assert " " not in value.replace("NVIDIA H100 80GB HBM3", "")  # compact, as Go writes it
    devices = json.loads(value)
    assert [d["index"] for d in devices] == [0, 1]
    for device in devices:
        assert set(device) == {"id", "index", "count", "devmem", "devcore", "type", "numa", "mode", "health"}
        assert device["id"].startswith("GPU-")
        assert (device["count"], device["devmem"], device["devcore"]) == (4, H100_MIB, 100)
        assert (device["type"], device["mode"], device["health"]) == ("NVIDIA H100 80GB HBM3", "hami-core", True)
    assert devices[0]["id"] != devices[1]["id"]
    # Stable per node and index, distinct across nodes.
    again = json.loads(peer.register_annotation("bench-gpu-0001", gpus=1, count=4, devmem_mib=1, product="x"))
    other = json.loads(peer.register_annotation("bench-gpu-0002", gpus=1, count=4, devmem_mib=1, product="x"))
    assert again[0]["id"] == devices[0]["id"] != other[0]["id"]


def test_handshake_is_a_fresh_request_in_go_datetime_local_time() -> None:
    now = time.mktime((2026, 3, 4, 5, 6, 7, 0, 0, -1))
    assert peer.handshake_annotation(now) == "Requesting_2026-03-04 05:06:07"
    assert re.fullmatch(r"Requesting_\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", peer.handshake_annotation())


def test_throughput_nodes_share_one_h100_four_ways() -> None:
    annotate, resources = _hami_nodes_and_pods()
    annotations = annotate("bench-gpu-0007")
    assert set(annotations) == {peer.REGISTER_ANNOTATION, peer.HANDSHAKE_ANNOTATION}
    [device] = json.loads(annotations[peer.REGISTER_ANNOTATION])
    assert (device["count"], device["devmem"], device["type"]) == (4, H100_MIB, "NVIDIA H100 80GB HBM3")
    assert resources == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "16312"}


def test_registered_nodes_from_hami_metrics() -> None:
    text = "\n".join([
        "# HELP hami_gpu_memory_limit_bytes Device memory limit for a certain GPU",
        'hami_gpu_memory_limit_bytes{device_index="0",device_type="NVIDIA",device_uuid="GPU-a",node="n1"} 8.5e+10',
        'hami_gpu_memory_limit_bytes{device_index="1",device_type="NVIDIA",device_uuid="GPU-b",node="n1"} 8.5e+10',
        'hami_gpu_memory_limit_bytes{device_index="0",device_type="NVIDIA",device_uuid="GPU-c",node="n2"} 8.5e+10',
        'hami_gpu_core_limit_ratio{device_index="0",device_type="NVIDIA",device_uuid="GPU-d",node="n3"} 1',
    ])
    assert peer.registered_nodes(text) == {"n1", "n2"}
    assert peer.registered_nodes("") == set()


# --------------------------------------------------------------------------- pods


@pytest.mark.parametrize(("utilization", "mib"), [("0.20", 16312), ("0.9", 73404), ("0.5", 40780), ("1", H100_MIB)])
def test_gpumem_is_what_vllm_reserves_rounded_up(utilization: str, mib: int) -> None:
    assert peer.gpumem_mib(utilization, H100_MIB) == mib


def test_pod_resources_ask_for_gpus_and_memory_per_gpu() -> None:
    assert peer.pod_resources("0.20", H100_MIB, gpus=2) == {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "16312"}


def test_wave_pods_ask_hami_for_memory_only_in_its_waves() -> None:
    plain = wave_pod("bench", "default-scheduler")
    extra = wave_pod("bench", "vramguard", peer.pod_resources(WAVE_UTILIZATION, H100_MIB))
    [plain_container] = plain["spec"]["containers"]
    [container] = extra["spec"]["containers"]
    assert "nvidia.com/gpumem" not in plain_container["resources"]["limits"]
    assert "nvidia.com/gpumem" not in plain_container["resources"]["requests"]
    for kind in ("limits", "requests"):
        assert container["resources"][kind]["nvidia.com/gpumem"] == "16312"
        assert container["resources"][kind]["nvidia.com/gpu"] == "1"
    assert (plain["spec"]["schedulerName"], extra["spec"]["schedulerName"]) == ("default-scheduler", "vramguard")
    assert "--gpu-memory-utilization" in container["args"]
    assert container["args"][container["args"].index("--gpu-memory-utilization") + 1] == WAVE_UTILIZATION


# --------------------------------------------------------------------------- the scheduler


def shipped_second() -> dict[str, object]:
    return services.load_yaml(services.SECOND_SCHEDULER_CONFIG)


def test_scheduler_config_is_hamis_chart_wiring() -> None:
    like = shipped_second()
    config = peer.scheduler_config(like)
    [extender] = config["extenders"]
    assert (extender["filterVerb"], extender["bindVerb"]) == ("filter", "bind")
    assert "prioritizeVerb" not in extender and "preemptVerb" not in extender
    assert extender["nodeCacheCapable"] is True
    assert (extender["weight"], extender["httpTimeout"]) == (1, "30s")
    managed = {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]}
    assert set(managed.values()) == {True}
    assert {"nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores", "nvidia.com/gpumem-percentage",
            "nvidia.com/priority"} <= set(managed)
    # The same profile name and API rate limit as the shipped second scheduler (and the stock one).
    assert config["profiles"] == [{"schedulerName": services.SECOND_SCHEDULER_NAME}]
    assert config["clientConnection"] == like["clientConnection"]
    stock = services.plain_scheduler_config(config)
    assert stock["clientConnection"] == services.plain_scheduler_config(like)["clientConnection"]


def test_scheduler_config_localized_keeps_mutual_tls_and_its_verbs(tmp_path: Path) -> None:
    local = services.localize_scheduler_config(
        peer.scheduler_config(shipped_second()), kubeconfig=tmp_path / "k", extender_url="https://127.0.0.1:4443",
        ca_b64="Q0E=", client_cert=(tmp_path / "c.crt", tmp_path / "c.key"), verbs=None)
    [extender] = local["extenders"]
    assert extender["urlPrefix"] == "https://127.0.0.1:4443"
    assert extender["enableHTTPS"] is True
    assert extender["tlsConfig"] == {"insecure": False, "caData": "Q0E=", "certFile": str(tmp_path / "c.crt"),
                                     "keyFile": str(tmp_path / "c.key")}
    assert local["leaderElection"] == {"leaderElect": False}
    only_filter = services.localize_scheduler_config(
        peer.scheduler_config(shipped_second()), kubeconfig=tmp_path / "k", extender_url="https://127.0.0.1:1",
        ca_b64="Q0E=", verbs=["filter"])
    assert "bindVerb" not in only_filter["extenders"][0] and only_filter["extenders"][0]["filterVerb"] == "filter"


def test_manifests_tree_gives_the_extender_identity_cluster_admin(tmp_path: Path) -> None:
    root = peer.write_manifests(tmp_path / "manifests", shipped_second())
    loaded = services.load_yaml(root / "scheduler" / "second-scheduler.yaml")
    assert loaded == peer.scheduler_config(shipped_second())
    identity = services.service_identity("extender", root)
    bindings = [o for o in services.rbac_objects([identity], root) if o["kind"] == "ClusterRoleBinding"]
    assert [b["roleRef"]["name"] for b in bindings] == ["cluster-admin"]
    assert bindings[0]["subjects"][0]["name"] == identity.name


def test_device_config_is_the_charts_nvidia_section() -> None:
    nvidia = yaml.safe_load(peer.device_config())["nvidia"]
    assert nvidia["resourceCountName"] == "nvidia.com/gpu"
    assert nvidia["resourceMemoryName"] == "nvidia.com/gpumem"
    assert (nvidia["defaultMemory"], nvidia["defaultGPUNum"], nvidia["memoryFactor"]) == (0, 1, 1)


def test_source_version_checks_the_tree(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        peer.source_version(tmp_path)
    (tmp_path / "go.mod").write_text("module github.com/Project-HAMi/HAMi\n\ngo 1.26\n")
    with pytest.raises(FileNotFoundError):
        peer.source_version(tmp_path)
    (tmp_path / "cmd" / "scheduler").mkdir(parents=True)
    (tmp_path / "cmd" / "scheduler" / "main.go").write_text("package main\n")
    assert peer.source_version(tmp_path) == "unknown"
    (tmp_path / "VERSION").write_text("v2.10.0")
    assert peer.source_version(tmp_path) == "v2.10.0"


# --------------------------------------------------------------------------- after the run


def test_hami_log_counts(tmp_path: Path) -> None:
    log = tmp_path / "hami.log"
    log.write_text("\n".join([
        'I1206 17:10:00.000001 1 scheduler.go:1068] "Starting schedule filter process" pod="a" uuid="u"',
        'I1206 17:10:00.000002 1 scheduler.go:1068] "Starting schedule filter process" pod="b" uuid="v"',
        'I1206 17:10:00.000003 1 scheduler.go:999] "Attempting to bind pod to node" pod="a" node="n"',
        'E1206 17:10:00.000004 1 scheduler.go:1040] "Failed to lock node" err="node n has been locked" node="n"',
        'I1206 17:10:00.000005 1 scheduler.go:1063] "Successfully bound pod to node" pod="a" node="n"',
    ]) + "\n")
    counts = hami_log_counts(log)
    assert counts == {"filters": 2, "filters_without_fit": 0, "binds": 1, "binds_done": 1, "node_lock_failures": 1,
                      "bind_failures": 0}
    assert hami_log_counts(tmp_path / "missing.log")["filters"] == 0


def test_process_memory_reads_proc() -> None:
    memory = process_memory(os.getpid())
    assert memory["rss_mib"] and memory["peak_rss_mib"] and memory["peak_rss_mib"] >= memory["rss_mib"]
    assert process_memory(2**22 + 12345) == {"rss_mib": None, "peak_rss_mib": None}


def test_summary_table_shows_hamis_records() -> None:
    peer_figures = {"hami_version": "v2.10.0", "hami_flags": ["--kube-qps=500"]}
    table = summary_table([
        {"bench": "throughput", "phase": "extender-memory", "extender": "hami", "nodes": 100, "pods": 400,
         "pid": 1, "rss_mib": 81.7, "peak_rss_mib": 94.0},
        {"bench": "throughput", "phase": "hami-log", "extender": "hami", "nodes": 100, "pods": 400,
         **peer_figures, **dict.fromkeys(HAMI_LOG_LINES, 3)},
        {"bench": "hami-filter", "phase": "filter", "nodes": 5000, "names": 500, "first_ms": 9.0,
         "filter": {"n": 59, "p50_ms": 1.5, "p99_ms": 2.5, "max_ms": 3.0}, "errors": 0, **peer_figures},
        {"bench": "hami-filter", "phase": "memory", "nodes": 5000, "rss_mib": 300.0, "peak_rss_mib": 320.0,
         **peer_figures},
    ])
    assert "| the extender process (hami) after the waves: RSS / peak RSS | 81.7 / 94.0 MiB |" in table
    assert "HAMi v2.10.0: filters and binds in its log" in table and "'node_lock_failures': 3" in table
    assert "| HAMi v2.10.0 https filter, 500 names of 5,000 nodes: p50 / p99 | 1.5 / 2.5 ms (n=59" in table
    assert "| HAMi after registering 5,000 nodes: RSS / peak RSS | 300.0 / 320.0 MiB |" in table


def test_hamis_metrics_have_no_verb_figures() -> None:
    # Why the hami run skips the extender-verbs record: HAMi's exposition has none of vramguard's series.
    figures = verb_figures('hami_gpu_memory_limit_bytes{node="n1"} 1\n')
    assert figures["mean_ms"] == {} and figures["requests"] == {}


# --------------------------------------------------------------------------- the launcher


def test_launcher_translates_the_harness_command_line() -> None:
    argv = launch.hami_argv("/bin/hami", listen="127.0.0.1:8443", tls_cert="c.crt", tls_key="c.key",
                            device_config="d.yaml", metrics="127.0.0.1:9395", extra=["--kube-qps=500"])
    assert argv == ["/bin/hami", "--http_bind=127.0.0.1:8443", "--cert_file=c.crt", "--key_file=c.key",
                    "--device-config-file=d.yaml", "--metrics-bind-address=127.0.0.1:9395",
                    "--scheduler-name=hami-scheduler", "--kube-qps=500"]


def test_launcher_offers_the_extender_only() -> None:
    base = [sys.executable, str(HAMI_LAUNCHER), "--binary", "x", "--device-config", "y"]
    assert subprocess.run([*base, "extender", "--help"], capture_output=True, check=False).returncode == 0
    assert subprocess.run([*base, "webhook", "--help"], capture_output=True, check=False).returncode == 2


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


def test_launcher_serves_ops_and_stops_its_child(tmp_path: Path) -> None:
    fake = tmp_path / "hami"
    fake.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/argv\"\nexec sleep 60\n")
    fake.chmod(0o755)
    port, ops = free_ports(2)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("{}")
    launcher = subprocess.Popen([sys.executable, str(HAMI_LAUNCHER), "--binary", str(fake), "--device-config",
                                 "d.yaml", "--hami-arg=--node-lock-timeout=1ms", "extender", "--listen",
                                 f"127.0.0.1:{port}", "--tls-cert", "c", "--tls-key", "k", "--kubeconfig",
                                 str(kubeconfig), "--policy", "p", "--client-ca", "ca", "--ops-listen",
                                 f"127.0.0.1:{ops}"])
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError):
                if _get(f"http://127.0.0.1:{ops}/healthz")[0] == 200 and (tmp_path / "argv").is_file():
                    break
            assert time.monotonic() < deadline, "the launcher's ops listener never answered"
            time.sleep(0.1)
        status, pid = _get(f"http://127.0.0.1:{ops}/pid")
        assert status == 200
        child = int(pid)
        assert Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"
        assert _get(f"http://127.0.0.1:{ops}/readyz")[0] == 503  # nothing answers on HAMi's port
        assert (tmp_path / "argv").read_text().split()[:2] == [f"--http_bind=127.0.0.1:{port}", "--cert_file=c"]
        assert "--node-lock-timeout=1ms" in (tmp_path / "argv").read_text()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=20) != 0
        assert not Path(f"/proc/{child}").exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_side_by_side_sets_vramguard_against_each_extender_of_the_run() -> None:
    from bench.extender import side_by_side  # noqa: PLC0415

    def ratio(extender: str, value: float) -> dict[str, object]:
        return {"bench": "throughput", "phase": "ratio", "extender": extender, "ratio_median_of_repeats": value}

    record = side_by_side([ratio("vramguard", 0.6), ratio("floor-h2", 0.75), ratio("hami", 0.05),
                           {"bench": "throughput", "phase": "skipped", "extender": "floor", "reason": "x"}])
    assert record["ratio_to_stock"] == {"vramguard": 0.6, "floor-h2": 0.75, "hami": 0.05}
    assert record["vramguard_over"] == {"floor-h2": 0.8, "hami": 12.0}
    assert record["skipped"] == ["floor"]


@pytest.mark.parametrize("value", ["", "vramguard,nope", "hami,hami"])
def test_extender_list_is_checked(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.extender import main  # noqa: PLC0415

    with pytest.raises(SystemExit):
        main(["--only", "throughput", "--extender", value])
    assert "--extender takes distinct names" in capsys.readouterr().err
