"""DeviceClasses and CEL selectors: which DRA devices a class (and a claim's selectors) could match.

vramguard does not evaluate CEL. It reads the conjunctions the NVIDIA driver's classes and common
claims write, and treats everything else as matching any device, which is conservative for what it
is used for: the largest device a request could get (an engine's fraction is a fraction of that),
so an unread clause can only make that device larger, never smaller.

Clauses read (joined by ``&&``; an expression with ``||`` or a leading ``!`` is not read at all):

- ``device.driver == 'gpu.nvidia.com'``
- ``device.attributes['gpu.nvidia.com'].type == 'gpu'`` (also ``productName``, ``profile``, ``uuid``)
- ``device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) <= 0`` (``<``, ``>=``, ``>``,
  ``==``), ``.isLessThan(quantity(...))``, ``.isGreaterThan(quantity(...))``
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vramguard.dra.devices import DEFAULT_DRIVERS, DraDevice
from vramguard.dra.fields import items, mapping, quantity_bytes, text

MAX_SELECTORS = 32
"""The API's limit per class or request; more are not read (and do not narrow)."""
MAX_EXPRESSION = 10_000
"""The API's CEL expression size limit in bytes; a longer one is not read (matches anything)."""
IMPLICIT_EXTENDED_RESOURCE_PREFIX = "deviceclass.resource.kubernetes.io/"
"""Every class is also reachable as ``<prefix><class name>`` on the DRA extended-resource path."""

_STRING = r"""(?:'([^'\\]*)'|"([^"\\]*)")"""
_DRIVER = re.compile(rf"^device\.driver\s*==\s*{_STRING}$")
_ATTRIBUTE = re.compile(rf"^device\.attributes\[{_STRING}\]\.(type|productName|profile|uuid)\s*==\s*{_STRING}$")
_MEMORY = re.compile(
    rf"^device\.capacity\[{_STRING}\]\.memory\.compareTo\(\s*quantity\(\s*{_STRING}\s*\)\s*\)\s*"
    r"(<=|<|>=|>|==)\s*0$"
)
_MEMORY_METHOD = re.compile(
    rf"^device\.capacity\[{_STRING}\]\.memory\.(isLessThan|isGreaterThan)\(\s*quantity\(\s*{_STRING}\s*\)\s*\)$"
)


@dataclass(frozen=True, slots=True)
class Selector:
    """What vramguard understood of a set of CEL selectors: each ``None`` means "any"."""

    driver: str | None = None
    attributes: tuple[tuple[str, str], ...] = ()
    """``(name, value)`` the device's attributes must equal (name without domain)."""
    min_memory: int | None = None
    """Inclusive lower bound on the device's memory."""
    max_memory: int | None = None
    """Inclusive upper bound on the device's memory."""
    impossible: bool = False
    """Two clauses contradict each other (two drivers): nothing matches."""

    def matches(self, device: DraDevice) -> bool:
        """Whether a device could satisfy these selectors."""
        if self.impossible or (self.driver is not None and device.driver != self.driver):
            return False
        values = {"type": device.type, "productName": device.product, "profile": device.profile, "uuid": device.uuid}
        if any(values.get(name) != value for name, value in self.attributes):
            return False
        if self.min_memory is not None and device.memory_bytes < self.min_memory:
            return False
        return self.max_memory is None or device.memory_bytes <= self.max_memory

    def narrowed(self, other: Selector) -> Selector:
        """Both selectors at once (a class's and a request's)."""
        impossible = self.impossible or other.impossible
        driver = self.driver
        if other.driver is not None:
            impossible |= driver is not None and driver != other.driver
            driver = other.driver
        bounds_min = [b for b in (self.min_memory, other.min_memory) if b is not None]
        bounds_max = [b for b in (self.max_memory, other.max_memory) if b is not None]
        return Selector(
            driver,
            tuple(dict.fromkeys(self.attributes + other.attributes)),
            max(bounds_min) if bounds_min else None,
            min(bounds_max) if bounds_max else None,
            impossible,
        )

    @property
    def device_type(self) -> str | None:
        """The ``type`` attribute required (``gpu``, ``mig``), if any."""
        return next((value for name, value in self.attributes if name == "type"), None)


ANY_DEVICE = Selector()


def read_selectors(raw: Any, notes: list[str] | None = None) -> Selector:
    """The selectors of a class or request (a list of ``{cel: {expression}}``), as understood."""
    notes = [] if notes is None else notes
    selector = ANY_DEVICE
    for entry in items(raw)[:MAX_SELECTORS]:
        expression = mapping(mapping(entry).get("cel")).get("expression")
        if isinstance(expression, str) and len(expression) <= MAX_EXPRESSION:
            selector = selector.narrowed(parse_expression(expression, notes))
    return selector


def parse_expression(expression: str, notes: list[str] | None = None) -> Selector:
    """One CEL expression as a :class:`Selector`; clauses not understood match anything."""
    flat = " ".join(expression.split())
    if "||" in flat or flat.startswith("!"):
        return ANY_DEVICE
    selector = ANY_DEVICE
    for part in flat.split("&&"):
        clause = part.strip()
        while clause.startswith("(") and clause.endswith(")"):
            clause = clause[1:-1].strip()
        selector = selector.narrowed(_clause(clause, notes if notes is not None else []))
    return selector


def _clause(clause: str, notes: list[str]) -> Selector:
    match = _DRIVER.match(clause)
    if match:
        return Selector(driver=match[1] if match[1] is not None else match[2])
    match = _ATTRIBUTE.match(clause)
    if match:
        value = match[4] if match[4] is not None else match[5]
        return Selector(attributes=((match[3], value),))
    match = _MEMORY.match(clause)
    if match:
        amount = quantity_bytes(match[3] if match[3] is not None else match[4], "selector quantity", notes)
        if amount is None:
            return ANY_DEVICE
        operator = match[5]
        if operator in ("<=", "<"):
            return Selector(max_memory=amount - (1 if operator == "<" else 0))
        if operator in (">=", ">"):
            return Selector(min_memory=amount + (1 if operator == ">" else 0))
        return Selector(min_memory=amount, max_memory=amount)
    match = _MEMORY_METHOD.match(clause)
    if match:
        amount = quantity_bytes(match[4] if match[4] is not None else match[5], "selector quantity", notes)
        if amount is None:
            return ANY_DEVICE
        return Selector(max_memory=amount - 1) if match[3] == "isLessThan" else Selector(min_memory=amount + 1)
    return ANY_DEVICE


@dataclass(frozen=True, slots=True)
class DeviceClassInfo:
    """A DeviceClass as vramguard reads it."""

    name: str
    selector: Selector = ANY_DEVICE
    extended_resource: str | None = None
    """``spec.extendedResourceName`` (e.g. ``nvidia.com/gpu``), when set."""
    created: str = ""
    """``metadata.creationTimestamp`` (RFC 3339 sorts as text): the newer class wins a shared name."""

    @property
    def driver(self) -> str | None:
        """The driver its selectors require, if any."""
        return self.selector.driver

    @property
    def device_type(self) -> str | None:
        """The device type its selectors require (``gpu``, ``mig``), if any."""
        return self.selector.device_type

    def selects_gpus(self, drivers: tuple[str, ...] = DEFAULT_DRIVERS) -> bool | None:
        """Whether the class selects GPU devices: its selectors name a GPU driver (or a ``gpu``/``mig``
        type) -> True; another driver -> False (a NIC, an FPGA); neither was read -> ``None``."""
        if self.selector.driver is not None:
            return self.selector.driver in drivers
        if self.selector.device_type is not None:
            return self.selector.device_type in ("gpu", "mig")
        return None

    def could_match(self, devices: Iterable[DraDevice], request: Selector = ANY_DEVICE) -> tuple[DraDevice, ...]:
        """The devices this class, narrowed by a request's selectors, could allocate."""
        selector = self.selector.narrowed(request)
        return tuple(d for d in devices if selector.matches(d))

    def largest(self, devices: Iterable[DraDevice], request: Selector = ANY_DEVICE) -> DraDevice | None:
        """The device with the most memory among :meth:`could_match`, ``None`` when none."""
        return max(self.could_match(devices, request), key=lambda d: d.memory_bytes, default=None)


def read_device_class(obj: Any, notes: list[str] | None = None) -> DeviceClassInfo | None:
    """A decoded DeviceClass, ``None`` when it has no name."""
    metadata = mapping(mapping(obj).get("metadata"))
    name = text(metadata.get("name"))
    if not name:
        return None
    spec = mapping(mapping(obj).get("spec"))
    return DeviceClassInfo(
        name=name,
        selector=read_selectors(spec.get("selectors"), notes),
        extended_resource=text(spec.get("extendedResourceName")) or None,
        created=text(metadata.get("creationTimestamp")) or "",
    )


def class_for_extended_resource(
    classes: Mapping[str, DeviceClassInfo] | Iterable[DeviceClassInfo], resource: str
) -> DeviceClassInfo | None:
    """The class that serves extended resource ``resource`` on the DRA path: the class naming it in
    ``extendedResourceName`` (the newest one; on a tie the first by name, as the scheduler picks), or
    the class named by ``deviceclass.resource.kubernetes.io/<class>``."""
    pool = list(classes.values()) if isinstance(classes, Mapping) else list(classes)
    named = [c for c in pool if c.extended_resource == resource]
    if named:
        newest = max(c.created for c in named)
        return min((c for c in named if c.created == newest), key=lambda c: c.name)
    if resource.startswith(IMPLICIT_EXTENDED_RESOURCE_PREFIX):
        wanted = resource.removeprefix(IMPLICIT_EXTENDED_RESOURCE_PREFIX)
        return next((c for c in pool if c.name == wanted), None)
    return None
