"""Allocate a known number of bytes on a real GPU and check the agent's NVML snapshot sees them.

Run by ``e2e/gpu/run.sh`` on a machine with an NVIDIA driver; not part of CI. Steps:

1. an NVML snapshot through the agent's :class:`agent.nvml.PynvmlBackend` (before);
2. a child process allocates ``--bytes`` with the CUDA driver API (``libcuda.so.1`` through
   ctypes: ``cuInit``, ``cuDevicePrimaryCtxRetain``, ``cuMemAlloc``), so no CUDA toolkit, PyTorch
   or CuPy is needed, and waits;
3. a second snapshot (after), while the child holds the memory;
4. the report the agent would write in both states, when the kubelet lists no pod on the node
   (so everything in use is foreign), and with processes attributed through ``/proc``.

Prints one JSON document with the readings and a verdict; exits 1 when the allocation is not seen.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

# Run from the repository root without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.nvml import NvmlUnavailable, PynvmlBackend, Snapshot, take_snapshot
from agent.processes import owner_of
from agent.recorded import snapshot_to_json
from agent.report import build_view, owners_for, snapshot_pids

CUDA_SUCCESS = 0


def allocate(size: int, device: int) -> None:
    """The child: hold ``size`` bytes on ``device`` until stdin closes; print ``ready`` once held."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(result: int, call: str) -> None:
        if result != CUDA_SUCCESS:
            name = ctypes.c_char_p()
            cuda.cuGetErrorName(result, ctypes.byref(name))
            raise SystemExit(f"{call} failed: {result} {name.value!r}")

    handle = ctypes.c_int()
    context = ctypes.c_void_p()
    pointer = ctypes.c_uint64()
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
    # The primary context: the same one the CUDA runtime (PyTorch, vLLM) would use.
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size)), "cuMemAlloc_v2")
    # Touch nothing: cuMemAlloc commits device memory at once, which is what NVML counts.
    print("ready", flush=True)
    sys.stdin.read()
    check(cuda.cuMemFree_v2(pointer), "cuMemFree_v2")


def snapshot() -> Snapshot:
    nvml = PynvmlBackend()
    nvml.init()
    try:
        return take_snapshot(nvml)
    finally:
        nvml.shutdown()


def report(taken: Snapshot) -> dict[str, Any]:
    """The report with the kubelet listing no pod, and processes attributed through /proc."""
    owners = owners_for(snapshot_pids(taken), partial(owner_of, proc_root=Path("/proc")))
    view = build_view(taken, [], {}, owners)
    return {"report": view.report.to_json(), "foreign_bytes": dict(view.foreign), "notes": list(view.notes)}


def device_used(taken: Snapshot, index: int) -> int | None:
    for gpu in taken.gpus:
        if gpu.index == index and gpu.memory is not None:
            return gpu.memory.used
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=8 << 30, help="bytes to allocate (default 8 GiB)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        allocate(args.bytes, args.device)
        return 0

    try:
        before = snapshot()
    except NvmlUnavailable as exc:
        print(json.dumps({"ok": False, "error": str(exc)}, indent=2))
        return 1
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", "--bytes", str(args.bytes), "--device", str(args.device)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        # Only this GPU: the CUDA ordinal then matches NVML's index in the common case.
        env={**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    )
    assert child.stdin is not None and child.stdout is not None
    started = time.monotonic()
    ready = child.stdout.readline().strip()
    held_after = time.monotonic() - started
    try:
        after = snapshot() if ready == "ready" else None
    finally:
        child.stdin.close()
        child.wait(60)
    released = snapshot()

    readings: dict[str, Any] = {
        "allocated_bytes": args.bytes,
        "device": args.device,
        "child_pid": child.pid,
        "child_ready": ready == "ready",
        "child_exit_code": child.returncode,
        "allocation_seconds": round(held_after, 3),
        "before": snapshot_to_json(before),
        "after": snapshot_to_json(after) if after is not None else None,
        "released": snapshot_to_json(released),
        "report_before": report(before),
        "report_after": report(after) if after is not None else None,
    }
    seen: dict[str, Any] = {"used_delta_bytes": None, "child_process": None}
    if after is not None:
        used_before, used_after = device_used(before, args.device), device_used(after, args.device)
        if used_before is not None and used_after is not None:
            seen["used_delta_bytes"] = used_after - used_before
        gpu = next((g for g in after.gpus if g.index == args.device), None)
        for process in (gpu.processes or ()) if gpu is not None else ():
            # NVML reports host PIDs: they match the child's only in the host's PID namespace.
            if process.pid == child.pid:
                seen["child_process"] = {"pid": process.pid, "used_bytes": process.used_bytes}
        if seen["child_process"] is None and gpu is not None:
            seen["processes"] = [{"pid": p.pid, "used_bytes": p.used_bytes} for p in gpu.processes or ()]
    readings["seen"] = seen
    delta = seen["used_delta_bytes"]
    process = seen["child_process"]
    readings["ok"] = bool(
        delta is not None and delta >= args.bytes
        and (process is None or (process["used_bytes"] or 0) >= args.bytes)
        and (process is not None or seen.get("processes"))
    )
    print(json.dumps(readings, indent=2, sort_keys=True))
    return 0 if readings["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
