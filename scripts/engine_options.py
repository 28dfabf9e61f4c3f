"""Build an engine release's own command-line parser and compare it with vramguard's tables.

    python scripts/engine_options.py vllm 0.34.0
    python scripts/engine_options.py sglang 0.5.23 --argv "--mem-frac 0.8" --argv "--pp 2"

Not run in CI (it downloads a release from PyPI). It reads the ``.py`` files of the release's wheel
(by HTTP range requests: a few MB of a wheel of hundreds), installs a few light libraries the engine
needs for real (numpy, pydantic, ...) in a throwaway virtualenv, and runs itself again there
(``--inside``) to import the modules that build the parser with everything heavy (torch, triton,
transformers, ...) replaced by inert stand-ins, and to capture the parser as the engine builds it:
vLLM's ``vllm serve`` subparser (``vllm.entrypoints.cli.main``, or ``vllm.scripts`` before v0.8),
SGLang's ``ServerArgs.add_cli_args``. It prints:

- whether the parser takes prefixes (``allow_abbrev``) and how many option strings it has;
- for each option vramguard reads (:data:`vramguard.engines.vllm.ABBREVIATIONS`,
  :data:`vramguard.engines.sglang.ABBREVIATIONS`), the longest prefix it shares with another option of
  that parser, next to what the table says for that version: a new release is a table row;
- with ``--argv``, what the real parser makes of each command line (or its error).

The stand-ins make most of an engine importable without a GPU (parsers of vLLM 0.5.5 to 0.34.0 and SGLang
0.4.0 to 0.5.23 built); a release that builds its parser from code they cannot satisfy fails with the
engine's traceback, which says what to stand in for next (:data:`QUIRKS`).
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import types
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

INDEX = "https://pypi.org/simple/{}/"
"""PyPI's simple index (its JSON form, PEP 691), which lists each release's wheels with their URL and size."""
REQUIREMENTS = ("numpy", "msgspec", "psutil", "pydantic", "regex", "requests", "PyYAML", "packaging",
                "cachetools", "dill")
"""Light libraries the engines' argument code uses for real (pydantic dataclasses, msgspec structs, ...)."""
GAP = 1 << 20
"""Members of the wheel this close together are downloaded in one request, with what lies between."""


def wheel_url(engine: str, version: str) -> tuple[str, int]:
    """The URL and size of the release's wheel (an x86_64 or pure-Python one where there is a choice)."""
    request = urllib.request.Request(INDEX.format(engine), headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request) as response:
        files = json.load(response)["files"]
    wheels = [f for f in files if f["filename"].endswith(".whl") and f["filename"].split("-")[1] == version]
    if not wheels:
        raise SystemExit(f"{engine} {version}: no wheel on PyPI")
    wheels.sort(key=lambda f: ("x86_64" not in f["filename"] and "-any." not in f["filename"], f["filename"]))
    return wheels[0]["url"], int(wheels[0]["size"])


class _Remote(io.RawIOBase):
    """A file on an HTTP server, read by ranges: each read is a request, except within a span fetched
    beforehand (:meth:`download`). A zip's central directory is at its end, so :class:`zipfile.ZipFile`
    lists a remote wheel with a few small reads."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.position = url, size, 0
        self.spans: list[tuple[int, bytes]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = (offset, self.position + offset, self.size + offset)[whence]
        return self.position

    def download(self, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (excluded), kept for the reads that follow."""
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end - 1}"})
        with urllib.request.urlopen(request) as response:
            data: bytes = response.read()
        self.spans.append((start, data))
        return data

    def readinto(self, buffer: Any) -> int:
        end = min(self.position + len(buffer), self.size)
        if end <= self.position:
            return 0
        for start, data in self.spans:
            if start <= self.position and end <= start + len(data):
                break
        else:
            start, data = self.position, self.download(self.position, end)
        buffer[:end - self.position] = data[self.position - start:end - start]
        count = end - self.position
        self.position = end
        return count


def fetch(engine: str, version: str, into: Path) -> None:
    """Unpack the release's ``.py`` files under ``into``, with a ``METADATA`` for the engine and for the
    stood-in libraries whose version the engine checks through :mod:`importlib.metadata`."""
    url, size = wheel_url(engine, version)
    remote = _Remote(url, size)
    with zipfile.ZipFile(remote) as archive:
        members = sorted(archive.infolist(), key=lambda member: member.header_offset)
        ends = [member.header_offset for member in members[1:]] + [size]
        spans: list[list[int]] = []
        for member, end in zip(members, ends, strict=True):
            if member.filename.endswith(".py"):  # one request for a run of them, compiled modules left out
                if spans and member.header_offset - spans[-1][1] < GAP:
                    spans[-1][1] = end
                else:
                    spans.append([member.header_offset, end])
        for start, end in spans:
            remote.download(start, end)
        for member in members:
            if member.filename.endswith(".py"):
                archive.extract(member, into)
    # vLLM's CPU platform plugin tells a CPU build by its version.
    local = "+cpu" if engine == "vllm" else ""
    for name, release in ((engine, version + local), ("transformers", "5.1.0"), ("torch", "2.10.0")):
        info = into / f"{name}-{release.split('+')[0]}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {release}\n")


# The stand-ins. Two meta-path finders (:class:`_StandIns`) share the work with the real ones:
# - in front, one answers for HEAVY and for the engine's own modules of QUIRKS, before the real finders;
# - the real finders import the engine's ``.py`` files, the light libraries and the standard library;
# - behind them, the other answers for any third-party module not installed (not for a missing submodule
#   of a real package: engines probe for optional features that way), except those of ABSENT.
# A stand-in module makes up any attribute it is asked for, once: a class of metaclass :class:`_Inert`,
# which is itself whatever it is used as (a function, a decorator, a base class, a type annotation, a
# number, a context manager), so that module-level code using torch & co. runs through.

HEAVY = ("torch", "triton", "transformers", "tokenizers", "huggingface_hub")
"""Roots of modules always stood in for: they need a GPU, or are large, or both."""
ABSENT = frozenset({"torch_npu", "torch_musa", "torch_mlu", "sgl_kernel_npu", "libtpu", "transformers_neuronx",
                    "neuronx_distributed", "habana_frameworks", "intel_extension_for_pytorch", "torch_neuronx",
                    "vllm_hpu_extension", "tpu_info", "torch_xla", "jax", "tpu_commons", "tpu_inference", "vllm_tpu",
                    "ray", "chardet"})
"""Accelerator plugins and optional libraries probed with ``import``: left missing, so that the probes
say "not here" (a stand-in would say "here")."""
NO_DEVICES = frozenset({"npu", "musa", "mlu", "hpu"})
"""Attributes engines probe on ``torch`` to detect other accelerators: missing, as on a CUDA build."""
QUIRKS = {"vllm": ("vllm.ir",), "sglang": ()}
"""Engine modules stood in for in every release (a prefix absent from one does no harm): they do at import
what no stand-in satisfies: ``vllm.ir`` splits the schema that torch's ``library`` module infers for its
ops (v0.34.0)."""
TEXTS = {"name": "stand_in", "ns": "stand_in", "_schema_str": "() -> ()"}
"""Attributes of a stand-in that are strings: names of torch ``library`` libraries and custom ops."""


class _Inert(abc.ABCMeta):
    """A class that is also any attribute, call, item, operand or decorator of itself and takes any class
    keyword. It equals any int (``torch.iinfo(torch.long).min == -2**63`` is asserted) and compares as both
    smaller and larger than anything (version checks read ``torch.__version__``)."""

    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> Any:
        return super().__new__(mcls, name, bases, namespace)

    def __init__(cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(name, bases, namespace)

    def __getattr__(cls, name: str) -> Any:
        if name == "__class_validators__":  # pydantic v1 asks a base class for it
            return {}
        if name in TEXTS:
            return TEXTS[name]
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _inert(name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not cls.__dict__.get("_stand_in", False):
            return type.__call__(cls, *args, **kwargs)  # a class of the engine's own deriving from one
        if len(args) == 1 and not kwargs and isinstance(args[0], types.FunctionType | type):
            return args[0]  # as a decorator: leave the function or class as it is
        return cls

    def register(cls, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else cls

    def __eq__(cls, other: Any) -> bool:
        return cls is other or type(other) is int

    def __hash__(cls) -> int:
        return id(cls)

    def __mro_entries__(cls, bases: Any) -> tuple[type, ...]:
        return (cls,)

    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        return importlib.import_module("pydantic_core.core_schema").any_schema()  # as a pydantic field: Any


# The other special methods answer whatever they are given: the stand-in itself, or a constant.
for _name in ("__getitem__", "__enter__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
              "__rpow__", "__matmul__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__lshift__",
              "__rshift__", "__neg__", "__invert__"):
    setattr(_Inert, _name, lambda cls, *args: cls)
for _name, _value in {"__iter__": iter(()), "__len__": 0, "__bool__": False, "__int__": 0, "__index__": 0,
                      "__float__": 0.0, "__contains__": False, "__exit__": None, "__lt__": False, "__gt__": False,
                      "__le__": True, "__ge__": True}.items():
    setattr(_Inert, _name, lambda cls, *args, _value=_value: _value)


def _inert(name: str) -> Any:
    """A new stand-in class: an instance of it (``torch.Tensor()``) makes up its attributes the same way."""
    return _Inert(name, (), {
        "__module__": "stand-in", "_stand_in": True, "__init__": lambda self, *a, **k: None,
        "__init_subclass__": classmethod(lambda cls, **kwargs: None),
        "__getattr__": lambda self, attribute: _inert(attribute),
    })


class _StandIn(types.ModuleType):
    """A stood-in module: each attribute is made up once, so that ``torch.float16 is torch.float16``."""

    def __getattr__(self, name: str) -> Any:
        if (name.startswith("__") and name.endswith("__")) or name in NO_DEVICES:
            raise AttributeError(name)
        value = _inert(name)
        setattr(self, name, value)
        return value


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for the modules under ``prefixes``, or (``behind`` the real finders) for any module
    that reached it, but for the standard library, :data:`ABSENT` and submodules of real packages."""

    def __init__(self, prefixes: Sequence[str] = (), behind: bool = False) -> None:
        self.prefixes, self.behind = tuple(prefixes), behind

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == prefix or fullname.startswith(prefix + ".") for prefix in self.prefixes):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        root = fullname.split(".", 1)[0]
        if not self.behind or root in sys.stdlib_module_names or root in ABSENT:
            return None
        if "." in fullname and not isinstance(sys.modules.get(root), _StandIn):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        module.__version__ = "2.10.0"  # type: ignore[attr-defined]
        module.__file__ = "stand-in"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Captured(Exception):
    """Raised in place of ``parse_args`` once the parser is built."""


def build_parser(engine: str) -> argparse.ArgumentParser:
    """The engine's own server parser, as it builds it."""
    if engine == "sglang":
        server_args = importlib.import_module("sglang.srt.server_args")
        parser = argparse.ArgumentParser(prog="sglang serve")
        server_args.ServerArgs.add_cli_args(parser)
        return parser
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    platforms = importlib.import_module("vllm.platforms")
    if hasattr(platforms, "resolve_current_platform_cls_qualname"):  # v0.7 on: plugins probe the hardware
        vars(platforms)["resolve_current_platform_cls_qualname"] = lambda: "vllm.platforms.cpu.CpuPlatform"
    captured: dict[str, argparse.ArgumentParser] = {}

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        captured["parser"] = self
        raise _Captured

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        sys.argv = ["vllm", "serve", "m"]
        try:
            entry = importlib.import_module("vllm.entrypoints.cli.main")
        except ModuleNotFoundError:
            entry = importlib.import_module("vllm.scripts")
        entry.main()
    except _Captured:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    top = captured["parser"]
    [subparsers] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    serve: argparse.ArgumentParser = subparsers.choices["serve"]
    return serve


def parse(engine: str, parser: argparse.ArgumentParser, argv: str) -> str:
    """What ``parser`` makes of the command line ``argv``: the values it sets apart from defaults, or its error."""
    model = ["m"] if engine == "vllm" else ["--model-path", "m"]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            defaults = vars(parser.parse_args(model))
            namespace = parser.parse_args(model + shlex.split(argv))
    except SystemExit:
        return f"error: {errors.getvalue().strip().splitlines()[-1]}"
    return str({k: v for k, v in vars(namespace).items() if k not in defaults or defaults[k] != v})


def inside(engine: str, work: Path, argvs: Sequence[str]) -> None:
    """In the throwaway virtualenv: build the parser from ``work/src`` and write ``work/parser.json``."""
    sys.path.insert(0, str(work / "src"))
    sys.meta_path.insert(0, _StandIns(HEAVY + QUIRKS[engine]))
    sys.meta_path.append(_StandIns(behind=True))
    parser = build_parser(engine)
    result = {"allow_abbrev": parser.allow_abbrev, "options": sorted(parser._option_string_actions),
              "argv": [[argv, parse(engine, parser, argv)] for argv in argvs]}
    (work / "parser.json").write_text(json.dumps(result))


def shared_prefix(options: Sequence[str], option: str) -> str:
    """The longest prefix ``option`` shares with another option string of the same kind (``--`` or ``-``)."""
    kind = option.startswith("--")
    same = (other for other in options if other != option and other.startswith("--") == kind)
    lengths = (next((i for i, (a, b) in enumerate(zip(option, other, strict=False)) if a != b),
                    min(len(option), len(other))) for other in same)
    return option[:max(lengths, default=0)]


def version_tuple(text: str) -> tuple[int, int, int]:
    """``0.4.6.post5`` -> ``(0, 4, 6)``."""
    parts = [int(p) for p in text.split(".post", 1)[0].split(".")[:3]] + [0, 0, 0]
    return parts[0], parts[1], parts[2]


def report(engine: str, version: str, built: dict[str, Any]) -> int:
    """Print the comparison; the number of options whose table row differs from the parser."""
    sys.path.insert(0, str(ROOT))
    table = importlib.import_module(f"vramguard.engines.{engine}").ABBREVIATIONS
    expected = table.at(version_tuple(version))
    options: list[str] = built["options"]
    print(f"{engine} {version}: allow_abbrev={built['allow_abbrev']}, {len(options)} option strings")
    differences = 0
    for option in table.shared:
        if option not in options:  # argparse reads it as a prefix of these, if any
            longer = [other for other in options if other.startswith(option)]
            print(f"  {option:34} absent" + (f": a prefix of {', '.join(longer)}" if longer else ""))
            continue
        found = shared_prefix(options, option) if built["allow_abbrev"] else option
        verdict = "matches" if found == expected[option] else f"DIFFERS (table: {expected[option]!r})"
        differences += found != expected[option]
        print(f"  {option:34} shares {found!r}: {verdict}")
    for argv, outcome in built["argv"]:
        print(f"  {argv!r}: {outcome}")
    return differences


def main(argv: Sequence[str] | None = None) -> int:
    """Fetch, build (in a throwaway virtualenv), compare; exit 1 when the table differs from the release."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=("vllm", "sglang"))
    parser.add_argument("version")
    parser.add_argument("--argv", action="append", default=[], help="a command line to parse (repeatable)")
    parser.add_argument("--inside", metavar="WORK", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        inside(args.engine, args.inside, args.argv)
        return 0
    with tempfile.TemporaryDirectory(prefix="engine-options-") as temporary:
        work = Path(temporary)
        fetch(args.engine, args.version, work / "src")
        venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *REQUIREMENTS], check=True)
        command = [str(venv / "bin" / "python"), __file__, args.engine, args.version, "--inside", str(work)]
        run = subprocess.run(command + [f"--argv={a}" for a in args.argv], check=False, capture_output=True, text=True)
        if run.returncode:  # the engine's own logging, then the import error: what to stand in for next
            sys.stderr.write(run.stdout + run.stderr)
            return run.returncode
        built = json.loads((work / "parser.json").read_text())
    return 1 if report(args.engine, args.version, built) else 0


if __name__ == "__main__":
    sys.exit(main())
