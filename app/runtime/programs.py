"""Programs compiled ahead of time, beside an artifact's ONNX graphs.

    model.pt2       AOTInductor package: torch.export'ed, compiled to native code for the export
                    machine's CPU capability level (x86-64-v4 for AVX512, v3 for AVX2); served
    model.pte       ExecuTorch program, XNNPACK delegate, fp32: for phones and edge devices
    model.int8.pte  the same, int8 with static (calibrated) scales

The manifest lists each under `programs` with the torch version that built it and, for the
`.pt2`, the machine and CPU capability it was compiled for; a process that cannot run it is
refused in one line before anything is loaded. A `.pt2` call holds Python's GIL (torch's
loader does not release it), unlike an ONNX Runtime call. `ProgramSession` gives every program ONNX Runtime's
`run(outputs, feeds)`, so replicas, predict actors and the export gate call all variants alike.
torch's AOTInductor entry points live in the private `torch._inductor`: every use is here.
"""

from __future__ import annotations

import io
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from app import storage
from app.errors import ArtifactError

SUFFIXES = {"aoti": ".pt2", "executorch": ".pte", "executorch_int8": ".int8.pte"}


def program_file(graph: str, variant: str) -> str:
    """A graph's program file: `model.pt2`, or per encoder `image.pt2`, `text.int8.pte`, ..."""
    return f"{graph}{SUFFIXES[variant]}"


PROGRAM_FILES = {v: program_file("model", v) for v in SUFFIXES}  # a single-graph artifact's
FORMATS = {"aoti": ("aoti",), "executorch": ("executorch", "executorch_int8")}
# torch.backends.cpu.get_cpu_capability(), ascending: a CPU runs code built for its own or a lower one.
CPU_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")
# The x86-64 level a `.pt2` is compiled for, by capability (not -march=native: the code must run
# on every CPU that reports the capability, whatever else the export machine has).
X86_LEVELS = {"DEFAULT": "x86-64-v2", "AVX2": "x86-64-v3", "AVX512": "x86-64-v4"}
AOTI_MIN_TORCH = (2, 6)  # aoti_compile_and_package(package_path=) / aoti_load_package


class ProgramInfo(storage.Contract):
    """A program's entry in the manifest: what a loader checks before it opens the file."""

    error = ArtifactError
    format: Literal["aoti", "executorch"]
    precision: Literal["fp32", "int8"]
    torch: str  # the torch version that built it
    cpu_capability: str | None = None  # the instruction set native code was compiled for
    machine: str | None = None  # platform.machine() of the export machine
    device: Literal["cpu", "cuda"] = "cpu"


def torch_release(version: str) -> str:
    """`2.13.0+cpu` -> `2.13.0`: the build tag names the wheel, not the ABI."""
    return version.split("+")[0]


def refusal(name: str, info: ProgramInfo) -> str | None:
    """Why this process cannot run the program `name` (one line), or None when it can."""
    import torch

    if torch_release(info.torch) != torch_release(torch.__version__):
        return f"{name}: built by torch {info.torch}, this process has torch {torch.__version__}"
    if info.device == "cuda" and not torch.cuda.is_available():
        return f"{name}: compiled for CUDA, and this process has no GPU"
    if info.machine and info.machine != platform.machine():
        return f"{name}: compiled for {info.machine}, this machine is {platform.machine()}"
    here = torch.backends.cpu.get_cpu_capability()
    built = info.cpu_capability
    if built and built != here and not _covers(here, built):
        return f"{name}: compiled for CPU capability {built}, this CPU has {here}"
    return None


def _covers(here: str, built: str) -> bool:
    if here not in CPU_CAPABILITIES or built not in CPU_CAPABILITIES:
        return False
    return CPU_CAPABILITIES.index(here) >= CPU_CAPABILITIES.index(built)


def cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


@dataclass(frozen=True)
class InputInfo:
    """What ONNX Runtime's `get_inputs()` tells about an input: its name and shape (free axes
    named), which batching reads to cut text to its longest row."""

    name: str
    shape: list[Any]


class ProgramSession:
    """A compiled program called like an ONNX Runtime session: `run(["logits"], feeds)`."""

    def __init__(
        self,
        call: Callable[..., Any],
        inputs: list[InputInfo],
        threads: int | None = None,
        max_batch: int | None = None,
    ):
        import torch

        if threads:  # native code runs on torch's (OpenMP) threads, one setting a process
            torch.set_num_threads(threads)
        self.call, self.inputs, self.max_batch = call, inputs, max_batch

    def get_inputs(self) -> list[InputInfo]:
        return self.inputs

    def run(self, output_names: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        args = [torch.from_numpy(np.ascontiguousarray(feeds[i.name])) for i in self.inputs]
        rows = len(args[0])
        if rows == 0:  # programs take a batch of one at least: run one, answer none
            with torch.inference_mode():
                return [
                    self._call([torch.zeros((1, *a.shape[1:]), dtype=a.dtype) for a in args])[:0]
                ]
        step = self.max_batch or rows or 1
        with torch.inference_mode():  # a program planned for at most `max_batch` rows a call
            parts = [self._call([a[s : s + step] for a in args]) for s in range(0, rows, step)]
        return [np.concatenate(parts) if len(parts) != 1 else parts[0]]

    def _call(self, args: list[Any]) -> np.ndarray:
        out = self.call(*args)
        return (out[0] if isinstance(out, list | tuple) else out).numpy()


def aoti_session(data: bytes, inputs: list[InputInfo], threads: int = 1) -> ProgramSession:
    _check_torch()
    import torch._inductor

    return ProgramSession(torch._inductor.aoti_load_package(io.BytesIO(data)), inputs, threads)


def executorch_session(data: bytes, inputs: list[InputInfo]) -> ProgramSession:
    """ExecuTorch's Python runtime: what the gate and the tests run a `.pte` through (phones run
    the same file through its C++, Java or Objective-C runtime)."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(data)
    method = program.load_method("forward")
    # Memory is planned for the largest batch the program was lowered for (its inputs' sizes).
    max_batch = program.metadata("forward").input_tensor_meta(0).sizes()[0]
    return ProgramSession(lambda *args: method.execute(list(args)), inputs, max_batch=max_batch)


def aoti_compile(exported: Any) -> bytes:
    """An ExportedProgram compiled by AOTInductor into a `.pt2` package's bytes."""
    _check_torch()
    import torch._inductor

    buffer = io.BytesIO()
    # Threads decided when the program runs (else the export process's count is compiled in).
    options: dict[str, Any] = {"cpp.dynamic_threads": True}
    if platform.machine() in ("x86_64", "AMD64"):
        options["cpp.march"] = X86_LEVELS.get(cpu_capability(), "x86-64-v2")
    torch._inductor.aoti_compile_and_package(
        exported, package_path=buffer, inductor_configs=options
    )
    return buffer.getvalue()


def _check_torch() -> None:
    import torch

    release = tuple(int(p) for p in torch_release(torch.__version__).split(".")[:2])
    if release < AOTI_MIN_TORCH:
        raise ArtifactError(
            f"AOTInductor packages need torch >= {'.'.join(map(str, AOTI_MIN_TORCH))}, "
            f"this process has {torch.__version__}"
        )
