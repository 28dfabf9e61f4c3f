"""Kubernetes objects that carry pods: where their pod template lives, and reading them from files."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

# The path to the pod template of each workload kind (batch CronJobs nest a Job template).
POD_TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
    "PodTemplate": ("template",),
}


class DocumentError(ValueError):
    """The input is not readable as Kubernetes objects."""


def pod_template(obj: Mapping[str, Any], kind: str | None = None) -> Mapping[str, Any] | None:
    """The pod (``metadata`` + ``spec``) that an object runs: itself for a Pod, else its template.

    ``kind`` overrides the object's own ``kind`` field (an AdmissionReview names it separately).
    """
    kind = kind if kind is not None else obj.get("kind")
    if kind == "Pod":
        return obj
    path = POD_TEMPLATE_PATHS.get(kind) if isinstance(kind, str) else None
    if path is None:
        return None
    node: Any = obj
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


MAX_YAML_NODES = 1_000_000
"""Nodes a YAML document may hold once its aliases are expanded. PyYAML shares an aliased node
instead of copying it, but whatever walks the result (a JSON digest, ``str()`` of a value, the
demand's reading) visits every copy: nine nested aliases in a few hundred characters are 10^8 items.
The largest object the API server stores (1.5 MiB) has far fewer nodes than this."""

MAX_SETTINGS_NODES = 100_000
"""The same bound for settings embedded as YAML text in an object (a RayService's serveConfigV2, a
KAITO ConfigMap): real ones have a few hundred nodes, and the webhook reads them within its timeout."""


class YamlTooLarge(yaml.YAMLError):
    """A YAML document whose aliases expand past the limit, or refer to themselves."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a document that expands past :attr:`max_nodes` (see
    :data:`MAX_YAML_NODES`) or holds a recursive alias."""

    max_nodes = MAX_YAML_NODES

    def compose_document(self) -> yaml.Node | None:
        node: yaml.Node | None = super().compose_document()
        if node is not None:
            _check_expanded(node, self.max_nodes)
        return node


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expanded(root: yaml.Node, limit: int) -> None:
    """Count the nodes of ``root`` as if every alias were a copy, each shared node once (linear in
    the document as written); :class:`YamlTooLarge` past ``limit`` or on a cycle."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, closing = stack.pop()
        key = id(node)
        if closing:
            open_nodes.discard(key)
            size = 1 + sum(sizes[id(child)] for child in _children(node))
            if size > limit:
                raise YamlTooLarge(f"its aliases expand to more than {limit:,} nodes")
            sizes[key] = size
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise YamlTooLarge("an alias refers to a node that contains it")
        open_nodes.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_nodes:
                raise YamlTooLarge("an alias refers to a node that contains it")
            if id(child) not in sizes:
                stack.append((child, False))


def load_yaml(text: str, max_nodes: int = MAX_YAML_NODES) -> Any:
    """One YAML document read with the safe loader, bounded (:data:`MAX_YAML_NODES`); raises
    :class:`yaml.YAMLError` (:class:`YamlTooLarge` among them) for what cannot be read."""
    return _load(text, _BoundedLoader, max_nodes)


def _load(text: str, loader_class: type[_BoundedLoader], max_nodes: int) -> Any:
    loader = loader_class(text)
    loader.max_nodes = max_nodes
    try:
        return loader.get_single_data()
    except RecursionError:
        raise YamlTooLarge("it is nested too deeply") from None
    finally:
        loader.dispose()


def _load_all(text: str) -> list[Any]:
    loader = _BoundedLoader(text)
    try:
        documents = []
        while loader.check_data():  # type: ignore[no-untyped-call]
            documents.append(loader.get_data())
        return documents
    except RecursionError:
        raise YamlTooLarge("it is nested too deeply") from None
    finally:
        loader.dispose()


def load_documents(text: str) -> list[Mapping[str, Any]]:
    """Every object in a JSON or (multi-document) YAML text, with ``kind: List`` items flattened."""
    try:
        documents: list[Any] = [json.loads(text)]
    except RecursionError:
        raise DocumentError("not valid JSON: it is nested too deeply") from None
    except ValueError:
        try:
            documents = _load_all(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise DocumentError(f"not valid YAML or JSON{where}: {getattr(exc, 'problem', exc)}") from None
    objects: list[Mapping[str, Any]] = []
    for document in documents:
        objects.extend(_flatten(document))
    return objects


def _flatten(document: Any) -> Iterator[Mapping[str, Any]]:
    if document is None:
        return
    if isinstance(document, list):
        for item in document:
            yield from _flatten(item)
        return
    if not isinstance(document, Mapping):
        raise DocumentError(f"expected a Kubernetes object, found {type(document).__name__}")
    kind = document.get("kind")
    if isinstance(kind, str) and kind.endswith("List") and isinstance(document.get("items"), list):
        for item in document["items"]:
            yield from _flatten(item)
        return
    yield document


@dataclass(frozen=True, slots=True)
class Document:
    """One document of a file: its objects, or why it could not be read."""

    index: int
    """1-based position of the document in the file."""
    objects: tuple[Mapping[str, Any], ...] = ()
    error: str | None = None


_SEPARATOR = re.compile(r"^---(?:[ \t].*)?$")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def load_each_document(text: str) -> list[Document]:
    """Every document of a JSON or multi-document YAML text, each read on its own.

    One document that is not valid YAML, or not a Kubernetes object, does not hide the others: it
    comes back with its error (and the line, counted in the whole file), the others with their
    objects. ``kind: List`` items are flattened.
    """
    try:
        whole: Any = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        return [Document(1, error="not valid JSON: it is nested too deeply")]
    except ValueError:
        pass  # not JSON, or JSON with a key twice: read as YAML, which says where
    else:
        return [_document(1, whole, 0)]
    documents: list[Document] = []
    lines = text.splitlines(keepends=True)
    start, chunk = 0, list[str]()
    for number, line in enumerate(lines):
        if _SEPARATOR.match(line.rstrip("\r\n")):
            if chunk or documents or number:
                documents.append(_parse(len(documents) + 1, "".join(chunk), start))
            start, chunk = number + 1, []
        else:
            chunk.append(line)
    documents.append(_parse(len(documents) + 1, "".join(chunk), start))
    return [d for d in documents if d.objects or d.error is not None]


class _StrictLoader(_BoundedLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice: YAML 1.2 forbids it, and the
    last value would win without a word (two files concatenated without ``---`` read as one object,
    the second Node's fields replacing the first's)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<": merged keys may be overridden, by design
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # an unhashable key: the base constructor says so
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"duplicate key {key!r} (two objects without '---' between them?)",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _parse(index: int, text: str, first_line: int) -> Document:
    try:
        value = _load(text, _StrictLoader, MAX_YAML_NODES)  # a SafeLoader: plain data only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {first_line + mark.line + 1}" if mark is not None else ""
        return Document(index, error=f"not valid YAML or JSON{where}: {getattr(exc, 'problem', None) or exc}")
    return _document(index, value, first_line)


def _document(index: int, value: Any, first_line: int) -> Document:
    try:
        return Document(index, tuple(_flatten(value)))
    except DocumentError as exc:
        return Document(index, error=f"{exc} (line {first_line + 1})")
