"""A claim's memory against the reservations of the containers using it; the pod side of claims."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from tests.dra_objects import claim_spec, device_class, gpu_device, resource_slice, vllm_claim_pod
from vramguard.demand import Vram
from vramguard.demand.model import Allowance
from vramguard.dra import (
    ClaimUse,
    DeviceClassInfo,
    Need,
    PodClaimSource,
    check_request,
    container_claim_uses,
    extended_resource_claim,
    memory_text,
    pod_claim_sources,
    read_claim_spec,
    read_device_class,
    read_resource_slices,
)
from vramguard.quantity import GiB, MiB


def _classes() -> dict[str, DeviceClassInfo]:
    info = read_device_class(device_class())
    assert info is not None
    return {info.name: info}


def _devices(mode: str | int, memory: str = "80Gi", extra: list[dict[str, Any]] | None = None) -> Any:
    return read_resource_slices(
        [resource_slice(devices=[gpu_device(mode=mode, memory=memory), *(extra or [])])]
    ).devices


VLLM_090 = Need("vllm", "vLLM", Vram(fraction=Fraction(9, 10)))


@pytest.mark.parametrize(
    ("mode", "memory", "needs", "message"),
    [
        pytest.param(
            "memory",
            "8Gi",
            [VLLM_090],
            "claim gpu requests 8Gi of memory but vLLM will reserve 0.90 x 80Gi = 72Gi; "
            "set capacity.requests.memory: 72Gi",
            id="under-request",
        ),
        pytest.param("memory", "72Gi", [VLLM_090], None, id="exact-request"),
        pytest.param("memory", None, [VLLM_090], None, id="memory-mode-default-whole"),
        pytest.param(
            "unlimited",
            None,
            [VLLM_090],
            "claim gpu sets no capacity.requests.memory, so it consumes 0 of a device shared without memory "
            "accounting (unlimited mode), but vLLM will reserve 0.90 x 80Gi = 72Gi; set capacity.requests.memory: 72Gi",
            id="unlimited-default-zero",
        ),
        pytest.param(
            4,
            None,
            [VLLM_090],
            "claim gpu sets no capacity.requests.memory, so it consumes 0 of a device shared by share count, "
            "but vLLM will reserve 0.90 x 80Gi = 72Gi; set capacity.requests.memory: 72Gi",
            id="share-count-default-zero",
        ),
        pytest.param("disabled", "8Gi", [VLLM_090], None, id="exclusive-takes-whole"),
        pytest.param(
            "memory",
            "16Gi",
            [Need("app", "container app's declaration", Vram(bytes=20 * GiB))],
            "claim gpu requests 16Gi of memory but container app's declaration will reserve 20Gi; "
            "set capacity.requests.memory: 20Gi",
            id="bytes-declaration",
        ),
        pytest.param(
            "memory",
            "40Gi",
            [Need("a", "vLLM", Vram(fraction=Fraction(3, 10))), Need("b", "vLLM", Vram(fraction=Fraction(3, 10)))],
            "claim gpu requests 40Gi of memory but vLLM will reserve 0.30 x 80Gi = 24Gi and vLLM will reserve "
            "0.30 x 80Gi = 24Gi; set capacity.requests.memory: 48Gi",
            id="two-containers-add-up",
        ),
        pytest.param(
            "memory",
            "24Gi",
            [
                Need("init", "vLLM", Vram(fraction=Fraction(3, 10)), init=True),
                Need("b", "vLLM", Vram(fraction=Fraction(3, 10))),
            ],
            None,
            id="init-runs-before",
        ),
        pytest.param(
            "memory",
            "24Gi",
            [
                Need("proxy", "container proxy's declaration", Vram(bytes=8 * GiB), sidecar=True, position=0),
                Need("init", "vLLM", Vram(fraction=Fraction(3, 10)), init=True, position=1),
                Need("b", "vLLM", Vram(fraction=Fraction(1, 10)), position=2),
            ],
            # kube-scheduler's phases: the init runs beside the sidecar started before it (8 + 24Gi),
            # more than the app beside the sidecar (8 + 8Gi).
            "claim gpu requests 24Gi of memory but container proxy's declaration will reserve 8Gi and vLLM will "
            "reserve 0.30 x 80Gi = 24Gi; set capacity.requests.memory: 32Gi",
            id="a-sidecar-runs-beside-a-later-init",
        ),
        pytest.param(
            "memory",
            "24Gi",
            [
                Need("init", "vLLM", Vram(fraction=Fraction(3, 10)), init=True, position=0),
                Need("proxy", "container proxy's declaration", Vram(bytes=8 * GiB), sidecar=True, position=1),
                Need("b", "vLLM", Vram(fraction=Fraction(1, 10)), position=2),
            ],
            None,
            id="a-sidecar-started-after-the-init",
        ),
        pytest.param(
            "memory",
            "20Gi",
            [Need("app", "container app's declaration", Vram(bytes=20 * GiB), floor=Vram(fraction=Fraction(3, 10)))],
            "claim gpu requests 20Gi of memory but container app's declaration will reserve 0.30 x 80Gi = 24Gi "
            "(the engine's own claim, above the declaration); set capacity.requests.memory: 24Gi",
            id="a-declaration-below-the-engines-claim",
        ),
    ],
)
def test_check_request(mode: str | int, memory: str | None, needs: list[Need], message: str | None) -> None:
    spec = read_claim_spec(claim_spec(memory=memory))
    check = check_request("gpu", spec.requests[0], needs, _classes(), _devices(mode))
    assert check.notes == ()
    assert (check.shortfall.message() if check.shortfall else None) == message


def test_h100_suggestion_is_rounded_to_the_policy_step() -> None:
    spec = read_claim_spec(claim_spec(memory="8Gi"))
    check = check_request("gpu", spec.requests[0], [VLLM_090], _classes(), _devices("memory", "81559Mi"))
    assert check.shortfall is not None
    # 0.9 x 81559Mi = 73403.1Mi, rounded up to the 1Mi step.
    assert check.shortfall.required == 73404 * MiB
    assert check.shortfall.message().endswith("0.90 x 81559Mi = 73404Mi; set capacity.requests.memory: 73404Mi")


def test_largest_matching_device_is_reported() -> None:
    l4 = gpu_device("gpu-1", uuid="GPU-L4", memory="23034Mi", product="NVIDIA L4")
    spec = read_claim_spec(claim_spec(memory="20Gi"))
    check = check_request("gpu", spec.requests[0], [VLLM_090], _classes(), _devices("memory", extra=[l4]))
    assert check.shortfall is not None and check.shortfall.device.name == "gpu-0"
    assert check.largest is not None and check.largest.name == "gpu-0"
    # A selector that keeps the L4 only: 0.9 x 23034Mi = 20731Mi > 20Gi.
    narrow = read_claim_spec(
        claim_spec(memory="20Gi", selectors=["device.attributes['gpu.nvidia.com'].productName == 'NVIDIA L4'"])
    )
    check = check_request("gpu", narrow.requests[0], [VLLM_090], _classes(), _devices("memory", extra=[l4]))
    assert check.shortfall is not None and check.shortfall.device.name == "gpu-1"
    assert check.shortfall.required == 20731 * MiB


def test_first_available_checks_every_alternative() -> None:
    spec = read_claim_spec(
        {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "firstAvailable": [
                            {
                                "name": "big",
                                "deviceClassName": "gpu.nvidia.com",
                                "capacity": {"requests": {"memory": "72Gi"}},
                            },
                            {
                                "name": "small",
                                "deviceClassName": "gpu.nvidia.com",
                                "capacity": {"requests": {"memory": "8Gi"}},
                            },
                        ],
                    }
                ]
            }
        }
    )
    check = check_request("gpu", spec.requests[0], [VLLM_090], _classes(), _devices("memory"))
    assert check.shortfall is not None
    assert check.shortfall.message().startswith("claim gpu request gpu/small requests 8Gi of memory")


@pytest.mark.parametrize(
    ("classes", "devices", "note"),
    [
        pytest.param({}, "memory", "DeviceClass gpu.nvidia.com is not known", id="unknown-class"),
        pytest.param(None, None, "no known device matches", id="no-devices"),
    ],
)
def test_unknown_leaves_a_note(classes: dict[str, DeviceClassInfo] | None, devices: str | None, note: str) -> None:
    spec = read_claim_spec(claim_spec(memory="8Gi"))
    check = check_request(
        "gpu",
        spec.requests[0],
        [VLLM_090],
        _classes() if classes is None else classes,
        _devices(devices) if devices else (),
    )
    assert check.shortfall is None
    assert any(note in n for n in check.notes), check.notes


def test_extended_resource_message() -> None:
    spec = read_claim_spec(claim_spec(request="container-0-request-0"))
    check = check_request("x", spec.requests[0], [VLLM_090], _classes(), _devices("unlimited"), "nvidia.com/gpu")
    assert check.shortfall is not None
    assert check.shortfall.message() == (
        "nvidia.com/gpu on DRA device class gpu.nvidia.com consumes 0 of memory on a device shared without memory "
        "accounting (unlimited mode) but vLLM will reserve 0.90 x 80Gi = 72Gi; use a ResourceClaim with "
        "capacity.requests.memory: 72Gi"
    )


def test_arithmetic_shows_the_allowances_beside_the_share() -> None:
    """The number to write covers what the engine holds beside its share (CUDA context, graphs), and the
    arithmetic says so; a ceiling's allowances are what it holds beyond it (graphs captured after)."""
    (device,) = _devices("memory")
    context = Allowance("CUDA context", 512 * MiB)
    fraction = Need("vllm", "vLLM", Vram(fraction=Fraction(9, 10), allowances=(context,)))
    assert fraction.on(device) == 72 * GiB + 512 * MiB
    assert fraction.arithmetic(device) == f"0.90 x 80Gi + 512Mi = {memory_text(72 * GiB + 512 * MiB)}"
    exact = Need("engine", "the engine", Vram(bytes=16 * GiB, allowances=(context,)))
    assert exact.arithmetic(device) == f"16Gi + 512Mi = {memory_text(16 * GiB + 512 * MiB)}"
    ceiling = Need("tgi", "TGI", Vram(fraction=Fraction(1, 2), ceiling=True))
    assert ceiling.arithmetic(device) == "0.50 x 80Gi = 40Gi"
    graphs = Allowance("CUDA graphs", GiB)
    beyond = Need("vllm", "vLLM", Vram(fraction=Fraction(1, 2), allowances=(graphs,), ceiling=True))
    assert beyond.arithmetic(device) == f"0.50 x 80Gi + 1Gi = {memory_text(41 * GiB)}"


def test_no_needs_no_check() -> None:
    spec = read_claim_spec(claim_spec(memory="8Gi"))
    assert check_request("gpu", spec.requests[0], [], _classes(), _devices("memory")).shortfall is None


@pytest.mark.parametrize(
    ("count", "text"),
    [(72 * GiB, "72Gi"), (0, "0"), (MiB, "1Mi"), (MiB + 1, "2Mi"), (73403 * MiB + 5, "73404Mi")],
)
def test_memory_text_never_below(count: int, text: str) -> None:
    assert memory_text(count) == text


def test_pod_claim_sources_and_uses() -> None:
    pod = vllm_claim_pod(request="gpu")
    pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "vllm-0-gpu-x7k9m"}, "junk"]}
    pod["spec"]["initContainers"] = [
        {"name": "warm", "resources": {"claims": [{"name": "gpu"}]}},
        {"name": "side", "restartPolicy": "Always", "resources": {"claims": [{"name": "gpu"}, {"name": 5}]}},
    ]
    (source,) = pod_claim_sources(pod)
    assert source == PodClaimSource("gpu", None, "gpu-4gi", "vllm-0-gpu-x7k9m")
    assert source.allocated_claim == "vllm-0-gpu-x7k9m"
    assert container_claim_uses(pod) == (
        ClaimUse("warm", "gpu", None, True),
        ClaimUse("side", "gpu", None, False),
        ClaimUse("vllm", "gpu", "gpu", False),
    )
    named = pod_claim_sources(vllm_claim_pod(claim_name="shared-gpu"))
    assert named == (PodClaimSource("gpu", "shared-gpu", None, None),)


@pytest.mark.parametrize(
    "pod",
    [{}, {"spec": None}, {"spec": {"resourceClaims": "x", "containers": [None, {"resources": {"claims": "y"}}]}}],
    ids=["empty", "spec-none", "junk"],
)
def test_junk_pods(pod: dict[str, Any]) -> None:
    assert pod_claim_sources(pod) == ()
    assert container_claim_uses(pod) == ()
    assert extended_resource_claim(pod) is None


def test_extended_resource_claim_status() -> None:
    pod = {
        "status": {
            "extendedResourceClaimStatus": {
                "resourceClaimName": "vllm-0-extended-resources-abcde",
                "requestMappings": [
                    {"containerName": "vllm", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}
                ],
            }
        }
    }
    status = extended_resource_claim(pod)
    assert status is not None
    assert status.claim_name == "vllm-0-extended-resources-abcde"
    assert status.requests == (("vllm", "nvidia.com/gpu", "container-0-request-0"),)


def test_devices_of_one_shape_are_checked_once() -> None:
    from vramguard.dra.sizing import distinct_shapes  # noqa: PLC0415

    same = [gpu_device(f"gpu-{i}", uuid=f"G{i}", memory="80Gi") for i in range(8)]
    other = gpu_device("gpu-8", uuid="G8", memory="40Gi")
    devices = read_resource_slices([resource_slice(devices=[*same, other])]).devices
    assert [d.name for d in distinct_shapes(devices)] == ["gpu-0", "gpu-8"]
    spec = read_claim_spec(claim_spec(memory="8Gi"))
    check = check_request("gpu", spec.requests[0], [VLLM_090], _classes(), devices)
    assert check.shortfall is not None and check.shortfall.device.name == "gpu-0"
