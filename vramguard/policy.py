"""The policy: QoS classes, enforcement modes and VRAM quotas, shared by the extender and the webhook.

A pod's class comes from its label ``vramguard.io/qos-class`` when its namespace's class allows
that class (``allows_pod_classes``), else from its namespace's label of the same name, else from
``default_class``. A class says which sharing strategies its pods may use
(``none``, ``time-slicing``, ``mps``, ``mig``), how to rank nodes (``binpack`` | ``spread``),
and what to do when a pod's VRAM is unknown
(``whole-gpu`` | ``reject``); the webhook reads ``max_vram_per_gpu``, ``require_mps_limit`` and
``allow_implicit_defaults``.

The policy file is YAML. Unknown keys are refused, and every validation error becomes one line
naming the key, so a typo in the file cannot silently change what is enforced. :class:`PolicyFile`
re-reads the file when its content changes and keeps the previous policy when the new one is
invalid: a bad edit must never take a service down.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from vramguard.codecs import ENFORCE_LABEL, QOS_CLASS_LABEL
from vramguard.demand.allowances import KINDS, AllowanceTable
from vramguard.demand.derive import DemandOptions
from vramguard.demand.model import Vram, VramError, parse_vram
from vramguard.inventory import DEFAULT_GPU_RESOURCES, DEFAULT_MIG_PREFIXES, SHARING_STRATEGIES, Sharing
from vramguard.learning import LearningRules
from vramguard.ledger_rule import BudgetRule
from vramguard.quantity import MAX_QUANTITY_TEXT, MiB, QuantityError, excerpt, parse_bytes
from vramguard.workloads import WorkloadKind

DEFAULT_POLICY_RESOURCE = "default_policy.yaml"

Enforcement = Literal["enforce", "warn", "audit"]
Scoring = Literal["binpack", "spread"]
UnknownVram = Literal["whole-gpu", "reject"]

# A class is chosen by a label value, so its name must be a valid label value.
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


class PolicyError(ValueError):
    """The policy file is unreadable or invalid; the message has one line per problem."""


def _text(value: Any) -> Any:
    # YAML turns `0.5` and `40` into numbers; quantities are read from their text.
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


Quantity = Annotated[str, BeforeValidator(_text)]


def parse_vram_limit(text: str) -> Vram:
    """A quantity (``40Gi``) or a fraction of the GPU (``0.5``, ``1``), as the annotation reads it."""
    try:
        return parse_vram(text)
    except VramError as exc:
        text = text.strip()
        match exc.reason:
            case "fraction":
                raise ValueError(f"{text}: a fraction of the GPU must be in (0, 1]") from None
            case "junk":
                raise ValueError(f"{text!r} is neither a quantity (like 40Gi) nor a fraction (like 0.5)") from None
            case "small":
                raise ValueError(f"{text!r} is under 1Mi; write a unit, for example 40Gi") from None
            case "huge":
                raise ValueError(
                    f"{excerpt(text)} is more than any GPU holds (a quantity of at most {MAX_QUANTITY_TEXT} "
                    "characters, under 8Ei); write the VRAM per GPU, for example 40Gi"
                ) from None


def _optional_bytes(value: str | None) -> str | None:
    """A quantity of bytes, or ``None``; a quantity that is not one is a validation error."""
    if value is not None:
        try:
            parse_bytes(value)
        except QuantityError as exc:
            raise ValueError(str(exc)) from None
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QosClass(_Strict):
    """What a class of pods may use and how they are placed."""

    description: str = ""
    sharing: tuple[Sharing, ...] = Field(min_length=1)
    """Sharing strategies of the GPUs its pods may be placed on."""
    headroom: Decimal | None = Field(default=None, ge=0, lt=1)
    """Deprecated (see :meth:`Policy.budget_rule`): read as the margin of the shared devices of the
    strategies the class allows. Allowances now count what it stood for (CUDA contexts, graphs)."""
    scoring: Scoring = "binpack"
    unknown_vram: UnknownVram = "whole-gpu"
    max_vram_per_gpu: Quantity | None = None
    """Largest reservation per GPU, a quantity or a fraction of the GPU (webhook)."""
    require_mps_limit: bool = False
    """Containers must set ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (webhook)."""
    allow_implicit_defaults: bool = True
    """Whether an engine's implicit default (vLLM's 0.92) is acceptable (webhook)."""
    allows_pod_classes: tuple[str, ...] | None = None
    """Classes a pod label may pick in a namespace of this class (default: only this class). A
    tenant labels its pods; only a namespace admin labels namespaces, so a pod must not escape
    its namespace's class by labelling itself."""
    trust_env_only_engines: bool = True
    """Whether an engine recognised only from environment variables (JAX's ``XLA_PYTHON_CLIENT_*``)
    is believed. Any container can set ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.01``; when false, such a
    container counts as unknown VRAM (``unknown_vram``) unless it declares its VRAM."""
    allow_visible_devices: bool = False
    """Whether a container may set ``NVIDIA_VISIBLE_DEVICES`` to name GPUs itself (webhook): where the
    container toolkit honours it, it reaches GPUs no scheduler counted (:mod:`vramguard.demand.visible`).
    A class for the GPU operator's own pods, or monitoring agents, may allow it."""
    enforce_memory_limits: bool = False
    """Whether the mutating webhook writes each GPU container's derived reservation as the
    container toolkit's ``NVIDIA_GPU_MEMORY_REQUEST``/``LIMIT`` (and, in an MPS-only class,
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) where the pod sets none (:mod:`vramguard.mutation`)."""

    @field_validator("sharing")
    @classmethod
    def _unique(cls, value: tuple[Sharing, ...]) -> tuple[Sharing, ...]:
        if len(set(value)) != len(value):
            raise ValueError("lists a strategy twice")
        return value

    @field_validator("max_vram_per_gpu")
    @classmethod
    def _vram_limit(cls, value: str | None) -> str | None:
        if value is not None:
            parse_vram_limit(value)
        return value

    @property
    def max_vram(self) -> Vram | None:
        """``max_vram_per_gpu`` parsed, or ``None``."""
        return parse_vram_limit(self.max_vram_per_gpu) if self.max_vram_per_gpu is not None else None


Margin = Annotated[Decimal, Field(ge=0, lt=1)]

DEFAULT_MARGIN = Decimal("0.03")
"""What a shared device keeps free by default: what no allowance models (allocator fragmentation,
the memory the driver keeps, about 0.5 to 0.75 GiB between NVML's and CUDA's totals on 80 GB GPUs)."""


class BudgetSettings(_Strict):
    """How much of each device pods may hold: the device's memory less a margin."""

    margins: dict[Sharing, Margin] = Field(default_factory=dict)
    """Margin of shared devices per sharing strategy (default 0.03 each)."""
    exclusive_margin: Margin = Decimal(0)
    """Margin of a device one pod owns (one replica, not shared by DRA): none by default, so a pod
    alone on a GPU is never refused for its own share."""


class AllowanceAmounts(_Strict):
    """Bytes per process per GPU of each allowance; unset: the level above decides."""

    cuda_context: Quantity | None = None
    """One CUDA context per process per GPU (default 512Mi)."""
    cuda_graphs: Quantity | None = None
    """CUDA graphs, where the engine version keeps them outside its share (default 1Gi)."""
    communication: Quantity | None = None
    """NCCL and custom all-reduce buffers of a process with parallel peers (default 1Gi)."""

    @field_validator("cuda_context", "cuda_graphs", "communication")
    @classmethod
    def _bytes(cls, value: str | None) -> str | None:
        return _optional_bytes(value)

    def as_bytes(self) -> dict[str, int]:
        """The amounts that are set, in bytes."""
        return {key: parse_bytes(value) for key in KINDS if (value := getattr(self, key)) is not None}


class AllowanceSettings(AllowanceAmounts):
    """The allowances counted beside every engine's share (see :mod:`vramguard.demand.allowances`)."""

    engines: dict[str, AllowanceAmounts] = Field(default_factory=dict)
    """Per engine (``vllm``, ``sglang``, ``tgi``, ``jax``, ``tensorrt-llm``)."""
    products: dict[str, AllowanceAmounts] = Field(default_factory=dict)
    """Per GPU product as GPU Feature Discovery names it (``NVIDIA H100 80GB HBM3``); wins over engines."""

    def table(self) -> AllowanceTable:
        """The amounts as the demand model reads them."""
        return AllowanceTable.of(
            self.as_bytes(),
            {engine: amounts.as_bytes() for engine, amounts in self.engines.items()},
            {product: amounts.as_bytes() for product, amounts in self.products.items()},
        )


class LearningSettings(_Strict):
    """Allowances learned from what pods really hold beyond their certain part (see
    :mod:`vramguard.learning`): kept by the extender's leader from the node agents' measurements."""

    enabled: bool = True
    """Learn, and count what was learned where it is more than the static estimates."""
    min_pods: int = Field(default=2, ge=1, le=64)
    """Pods of a key measured before its learned value counts."""
    step: Quantity = "1Gi"
    """The most a learned value moves in one round (a minute): no jump, no flapping."""
    max_age_hours: Decimal = Field(default=Decimal(168), gt=0, le=24 * 365)
    """A pod not measured for this long no longer counts (and a key without pods is forgotten)."""
    downward: bool = False
    """Also count a learned value below the static estimates, once the evidence below is met."""
    downward_min_pods: int = Field(default=20, ge=1, le=64)
    downward_min_hours: Decimal = Field(default=Decimal(168), ge=0, le=24 * 365)
    """How long the key must have been measured before a value below the static estimates counts."""

    @field_validator("step")
    @classmethod
    def _step(cls, value: str) -> str:
        try:
            amount = parse_bytes(value)
        except QuantityError as exc:
            raise ValueError(str(exc)) from None
        if amount < MiB:
            raise ValueError("must be at least 1Mi")
        return value

    def rules(self) -> LearningRules:
        """The settings as the rounds use them (bytes and seconds)."""
        return LearningRules(
            self.enabled, self.min_pods, parse_bytes(self.step), float(self.max_age_hours) * 3600,
            self.downward, self.downward_min_pods, float(self.downward_min_hours) * 3600,
        )


class Routing(_Strict):
    """Where the mutating webhook sends GPU pods that name no scheduler (:mod:`vramguard.mutation`)."""

    enabled: bool = True
    scheduler: str | None = Field(default=None, min_length=1)
    """Default: the first of ``schedulers`` that is not ``default-scheduler``."""


class DirectPlacement(_Strict):
    """Who may create GPU pods with ``spec.nodeName`` set that do not fit the node's ledger.

    Such pods bypass the scheduler and its extender; the webhook admits one in an ``enforce``
    namespace only when it fits, or when its creator is listed here (the kubelet's mirror pods
    belong to ``system:nodes``).
    """

    allowed_users: tuple[str, ...] = ()
    allowed_groups: tuple[str, ...] = ()

    def allows(self, user: str, groups: tuple[str, ...]) -> bool:
        """Whether the requester (``request.userInfo``) is allow-listed."""
        return user in self.allowed_users or any(group in self.allowed_groups for group in groups)


@dataclass(frozen=True, slots=True)
class ClassChoice:
    """The class a pod falls in, where that came from, and what was wrong on the way."""

    name: str
    qos: QosClass
    source: Literal["pod", "namespace", "default"]
    problem: str | None = None
    enforcement: Enforcement = "enforce"
    """The pod's namespace's mode: class rules refuse a node only under ``enforce`` (the VRAM budget
    holds in every mode)."""


@functools.lru_cache(maxsize=1)
def shipped_workload_kinds() -> tuple[WorkloadKind, ...]:
    """The ``workload_kinds`` of the shipped policy, the default of a policy that omits them."""
    text = importlib.resources.files("vramguard").joinpath(DEFAULT_POLICY_RESOURCE).read_text("utf-8")
    data = yaml.safe_load(text)
    return tuple(WorkloadKind.model_validate(kind) for kind in data.get("workload_kinds") or ())


Autoscaler = Literal["none", "cluster-autoscaler", "karpenter"]
SCALE_UP_LABEL = "vramguard.io/node"
"""The node label Karpenter-mode narrowing excludes nodes by (Karpenter ignores pods that name
``kubernetes.io/hostname``): the extender gives it each GPU node without one."""


class ScaleUp(_Strict):
    """New nodes for GPU pods no existing GPU has the VRAM for (:mod:`vramguard.scale_up`,
    docs/autoscaling.md): the mutating webhook gates the pods of these classes at creation, and the
    extender's leader lifts the gate, narrowing the pod's node affinity away from the nodes that
    cannot hold it when none can, so the autoscaler's own simulation asks for a node."""

    autoscaler: Autoscaler = "none"
    """Which autoscaler adds the nodes: it decides how nodes are excluded (``cluster-autoscaler``:
    ``kubernetes.io/hostname NotIn``; ``karpenter``: ``vramguard.io/node NotIn``). ``none``: no gate."""
    classes: tuple[str, ...] = ("*",)
    """The classes whose GPU pods are gated (``*``: every class). A gated pod no longer waits for
    VRAM freed on the nodes it was steered away from: it waits for its new node."""
    protect_from_scale_down: bool = True
    """Gated pods are also created with the autoscaler's do-not-disrupt annotation
    (``cluster-autoscaler.kubernetes.io/safe-to-evict: "false"``, ``karpenter.sh/do-not-disrupt:
    "true"``) unless they set it: both autoscalers re-place a node's pods by GPU count when they
    scale down, not by VRAM, so a GPU node holding such pods is never removed by them (an empty one
    still is)."""
    largest_gpu_memory: Quantity | None = None
    """The memory of the largest GPU a node the autoscaler may add has (e.g. ``80Gi``). A pod is held
    when neither an empty node of the shape of a GPU node it may use nor a GPU of this size could
    hold it; with it unset, a pod whose pool is scaled to zero (no GPU node it may use to compare
    with) is released."""
    release_timeout_seconds: int = Field(default=300, ge=30, le=86400)
    """A released pod still ``Unschedulable`` this long after (its new node filled first, or the
    autoscaler packed it by replica count) is evicted, when a ReplicaSet or a StatefulSet owns it,
    so its owner recreates it and it is decided again; each further pod of the same owner evicted
    so waits twice as long (up to 16 times). Evicted while its node is still coming, the new pod is
    narrowed again and the autoscaler counts the node in flight: a restart, not a second node."""

    @field_validator("largest_gpu_memory")
    @classmethod
    def _largest(cls, value: str | None) -> str | None:
        return _optional_bytes(value)

    def gates(self, class_name: str) -> bool:
        """Whether pods of ``class_name`` are gated."""
        return self.autoscaler != "none" and ("*" in self.classes or class_name in self.classes)

    def largest_gpu_bytes(self) -> int | None:
        """:attr:`largest_gpu_memory` in bytes."""
        return parse_bytes(self.largest_gpu_memory) if self.largest_gpu_memory is not None else None


class Policy(_Strict):
    """The whole policy file."""

    default_class: str = "best-effort"
    classes: dict[str, QosClass] = Field(min_length=1)
    enforcement: Enforcement = "warn"
    """Default enforcement of namespaces without a ``vramguard.io/enforce`` label (webhook)."""
    quotas: dict[str, Quantity] = Field(default_factory=dict)
    """VRAM quota per namespace: the sum over its live GPU pods (webhook)."""
    gpu_resources: tuple[str, ...] = DEFAULT_GPU_RESOURCES
    """Extended resources that are GPUs or GPU replicas."""
    gpu_resource_prefixes: tuple[str, ...] = DEFAULT_MIG_PREFIXES
    """Prefixes of resources that are MIG instances (``nvidia.com/mig-<profile>``)."""
    schedulers: tuple[str, ...] = Field(default=("vramguard",), min_length=1)
    """Scheduler names (profiles) whose kube-scheduler calls the vramguard extender: the extender
    binds only their pods, and a GPU pod naming another scheduler would walk around the guard."""
    routing: Routing = Field(default_factory=Routing)
    """GPU pods naming no scheduler (or ``default-scheduler``) are routed to the vramguard scheduler
    at creation (mutating webhook); a namespace labelled ``vramguard.io/routing: disabled`` opts out."""
    direct_placement: DirectPlacement = Field(default_factory=DirectPlacement)
    """Requesters allowed to place GPU pods directly (``spec.nodeName``) past the ledger (webhook)."""
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    """Each device's budget: its memory less a margin (shared devices) or none (exclusive ones)."""
    allowances: AllowanceSettings = Field(default_factory=AllowanceSettings)
    """What processes hold beside their engine's share, per process per GPU."""
    learning: LearningSettings = Field(default_factory=LearningSettings)
    """Allowances learned from what the agents measure pods holding beyond their certain part."""
    scale_up: ScaleUp = Field(default_factory=ScaleUp)
    """Scheduling gates that let an autoscaler add a node for a pod no existing GPU can hold."""
    workload_kinds: tuple[WorkloadKind, ...] = Field(default_factory=shipped_workload_kinds)
    """Custom resources that run pods, with their pod templates and replica fields (see
    :mod:`vramguard.workloads`). Omitted: the shipped policy's list, whose namespaced kinds the shipped
    webhook configuration registers (a cluster-scoped runtime is reviewed only through the objects that
    use it); ``[]`` reads none."""

    @field_validator("workload_kinds")
    @classmethod
    def _unique_kinds(cls, value: tuple[WorkloadKind, ...]) -> tuple[WorkloadKind, ...]:
        seen = [(k.group, k.kind) for k in value]
        twice = sorted({f"{kind}.{group}" for group, kind in seen if seen.count((group, kind)) > 1})
        if twice:
            raise ValueError(f"workload kinds named twice: {', '.join(twice)}")
        return value

    @field_validator("classes")
    @classmethod
    def _class_names(cls, value: dict[str, QosClass]) -> dict[str, QosClass]:
        bad = [name for name in value if not _LABEL_VALUE.match(name)]
        if bad:
            raise ValueError(f"class names must be valid label values: {', '.join(map(repr, bad))}")
        return value

    @field_validator("quotas")
    @classmethod
    def _quotas(cls, value: dict[str, str]) -> dict[str, str]:
        for namespace, quantity in value.items():
            try:
                parse_bytes(quantity)
            except QuantityError as exc:
                raise ValueError(f"namespace {namespace}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _default_exists(self) -> Policy:
        if self.default_class not in self.classes:
            raise ValueError(
                f"default_class {self.default_class!r} is not a class (classes: {', '.join(self.classes)})"
            )
        unknown_gated = [c for c in self.scale_up.classes if c != "*" and c not in self.classes]
        if unknown_gated:
            raise ValueError(
                f"scale_up.classes: {', '.join(map(repr, unknown_gated))} is not a class "
                f"(classes: {', '.join(self.classes)})"
            )
        for name, qos in self.classes.items():
            unknown = [c for c in qos.allows_pod_classes or () if c not in self.classes]
            if unknown:
                raise ValueError(
                    f"classes.{name}.allows_pod_classes: {', '.join(map(repr, unknown))} is not a class "
                    f"(classes: {', '.join(self.classes)})"
                )
        return self

    def pod_classes_under(self, namespace_class: str) -> tuple[str, ...]:
        """The classes a pod label may pick in a namespace of ``namespace_class`` (itself at least)."""
        allowed = self.classes[namespace_class].allows_pod_classes
        return tuple(dict.fromkeys((namespace_class, *(allowed or ()))))

    @classmethod
    def from_yaml(cls, text: str) -> Policy:
        """Parse and validate a policy; raise :class:`PolicyError` with one line per problem."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise PolicyError(f"policy is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
        if not isinstance(data, Mapping):
            raise PolicyError("policy must be a YAML mapping (keys default_class, classes, ...)")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise PolicyError(describe_errors(exc)) from None

    def choose_class(
        self, pod_labels: Mapping[str, str] | None, namespace_labels: Mapping[str, str] | None
    ) -> ClassChoice:
        """The pod's class: its label when its namespace's class allows it, else the namespace's class.

        The namespace's class is its label, else the default class. A label naming no class, or a
        pod label naming a class its namespace's class does not allow (``allows_pod_classes``), is
        ignored and reported in ``problem``, so the webhook can tell the user and the extender can
        still place the pod.
        """
        problems: list[str] = []
        namespace_name = (namespace_labels or {}).get(QOS_CLASS_LABEL)
        source: Literal["pod", "namespace", "default"] = "namespace"
        mode = self.enforcement_for(namespace_labels)[0]
        if namespace_name is not None and namespace_name not in self.classes:
            problems.append(
                f"namespace label {QOS_CLASS_LABEL}={namespace_name} names no class "
                f"(classes: {', '.join(self.classes)})"
            )
            namespace_name = None
        if namespace_name is None:
            namespace_name, source = self.default_class, "default"
        asked = (pod_labels or {}).get(QOS_CLASS_LABEL)
        if asked is not None:
            allowed = self.pod_classes_under(namespace_name)
            if asked not in self.classes:
                problems.insert(
                    0, f"pod label {QOS_CLASS_LABEL}={asked} names no class (classes: {', '.join(self.classes)})"
                )
            elif asked not in allowed:
                problems.insert(
                    0,
                    f"pod label {QOS_CLASS_LABEL}={asked} is not allowed in a namespace of class "
                    f"{namespace_name} (allowed: {', '.join(allowed)})",
                )
            else:
                return ClassChoice(asked, self.classes[asked], "pod", "; ".join(problems) or None, mode)
        return ClassChoice(
            namespace_name, self.classes[namespace_name], source, "; ".join(problems) or None, mode
        )

    def margin_for(self, sharing: Sharing) -> Fraction:
        """The margin of shared devices of ``sharing``: ``budget.margins`` when it names the strategy;
        else, for a policy written before margins existed, the largest ``headroom`` set by a class
        allowed on such devices (the old meaning, now for shared devices only); else the default."""
        explicit = self.budget.margins.get(sharing)
        if explicit is not None:
            return Fraction(explicit)
        old = [c.headroom for c in self.classes.values() if c.headroom is not None and sharing in c.sharing]
        return Fraction(max(old)) if old else Fraction(DEFAULT_MARGIN)

    def budget_rule(self) -> BudgetRule:
        """Every device's margin, for the ledger."""
        margins = {sharing: self.margin_for(sharing) for sharing in SHARING_STRATEGIES}
        return BudgetRule(margins, Fraction(self.budget.exclusive_margin))

    def demand_options(self) -> DemandOptions:
        """What the demand model needs of the policy: which resources are GPUs, the allowances."""
        return DemandOptions(
            frozenset(self.gpu_resources), tuple(self.gpu_resource_prefixes), self.allowances.table()
        )

    def quota_bytes(self, namespace: str) -> int | None:
        """The namespace's VRAM quota in bytes, or ``None`` when it has none."""
        quantity = self.quotas.get(namespace)
        return parse_bytes(quantity) if quantity is not None else None

    def enforcement_for(self, namespace_labels: Mapping[str, str] | None) -> tuple[Enforcement, str | None]:
        """The namespace's enforcement mode from its ``vramguard.io/enforce`` label, else the default.

        An invalid label value falls back to the default and is reported as the second item.
        """
        value = (namespace_labels or {}).get(ENFORCE_LABEL)
        if value in ("enforce", "warn", "audit"):
            return value, None  # type: ignore[return-value]
        if value is None:
            return self.enforcement, None
        return self.enforcement, (
            f"namespace label {ENFORCE_LABEL}={value} is not enforce, warn or audit; "
            f"using {self.enforcement}"
        )


def describe_errors(error: ValidationError) -> str:
    """One line per validation problem, naming the key, e.g. ``classes.gold.headroom: ...``."""
    lines = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            parent = ".".join(str(part) for part in item["loc"][:-1])
            allowed = ", ".join(_allowed_keys(item["loc"][:-1]))
            where = f" in {parent}" if parent else ""
            lines.append(f"unknown key {item['loc'][-1]!r}{where} (allowed: {allowed})")
        elif item["type"] == "missing":
            lines.append(f"{location}: required")
        else:
            message = item["msg"].removeprefix("Value error, ")
            lines.append(f"{location}: {message}" if location else message)
    return "invalid policy:\n  " + "\n  ".join(lines)


def _allowed_keys(parent: tuple[int | str, ...]) -> list[str]:
    model: type[BaseModel] = Policy
    if len(parent) == 2 and parent[0] == "classes":
        model = QosClass
    elif parent == ("direct_placement",):
        model = DirectPlacement
    elif parent == ("budget",):
        model = BudgetSettings
    elif parent == ("allowances",):
        model = AllowanceSettings
    elif parent == ("learning",):
        model = LearningSettings
    elif len(parent) == 3 and parent[0] == "allowances":
        model = AllowanceAmounts
    return list(model.model_fields)


def read_failure(exc: OSError | UnicodeDecodeError) -> str:
    """Why a file could not be read, in words (``is a directory``, ``no such file or directory``,
    ``not UTF-8 text``), without the exception's own form (``[Errno 21] ...``)."""
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text"
    reason = exc.strerror or str(exc)
    return reason[:1].lower() + reason[1:]


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; raise :class:`PolicyError` naming the file on any problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"cannot read policy {path}: {read_failure(exc)}") from None
    try:
        return Policy.from_yaml(text)
    except PolicyError as exc:
        raise PolicyError(f"{path}: {exc}") from None


def default_policy() -> Policy:
    """The policy shipped with vramguard (``vramguard/default_policy.yaml``)."""
    text = importlib.resources.files("vramguard").joinpath(DEFAULT_POLICY_RESOURCE).read_text("utf-8")
    return Policy.from_yaml(text)


class PolicyFile:
    """A policy file that is re-read when its content changes, keeping the last good policy.

    The file's stat (inode, size, modification time) is checked first, so a reload that finds no
    change costs one ``stat``; Kubernetes swaps ConfigMap files through a symlink, which changes
    the inode. Content is compared by hash, so a touch without a change parses nothing.
    """

    def __init__(self, path: str | Path) -> None:
        """Load the policy at ``path``; raise :class:`PolicyError` when it is invalid."""
        self.path = Path(path)
        self._stamp = self._stat()
        self._digest, text = self._read()
        try:
            self.policy = Policy.from_yaml(text)
        except PolicyError as exc:
            raise PolicyError(f"{self.path}: {exc}") from None

    def reload(self) -> tuple[Policy, str | None]:
        """The current policy and, when the file changed into something unusable, why it was kept."""
        stamp = self._stat()
        if stamp == self._stamp and stamp is not None:
            return self.policy, None
        self._stamp = stamp
        try:
            digest, text = self._read()
        except PolicyError as exc:
            return self.policy, f"{exc}; keeping the previous policy"
        if digest == self._digest:
            return self.policy, None
        try:
            policy = Policy.from_yaml(text)
        except PolicyError as exc:
            return self.policy, f"{self.path}: {exc}\nkeeping the previous policy"
        self._digest, self.policy = digest, policy
        return policy, None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            info = self.path.stat()
        except OSError:
            return None
        return info.st_ino, info.st_size, info.st_mtime_ns

    def _read(self) -> tuple[str, str]:
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise PolicyError(f"cannot read policy {self.path}: {read_failure(exc)}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PolicyError(f"policy {self.path} is not UTF-8: {exc}") from None
        return hashlib.sha256(data).hexdigest(), text
