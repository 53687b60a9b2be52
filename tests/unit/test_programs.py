"""A compiled program as the runtime calls it, without a compiler: `ProgramSession` (ONNX
Runtime's `run()` over any callable: an empty batch, batches split at the program's bound) and
the refusal of a program built for another torch, machine or CPU."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from app.runtime import programs as prg

pytestmark = pytest.mark.unit
WEIGHTS = torch.arange(12, dtype=torch.float32).reshape(4, 3)


def session(max_batch: int | None = None, calls: list | None = None) -> prg.ProgramSession:
    def call(x):
        if calls is not None:
            calls.append(len(x))
        assert len(x) >= 1, "programs take one row at least"
        return [x @ WEIGHTS]

    return prg.ProgramSession(call, [prg.InputInfo("x", ["batch", -1])], max_batch=max_batch)


def test_a_session_answers_as_the_callable_with_batches_split_at_its_bound():
    x = np.random.default_rng(0).normal(size=(7, 4)).astype(np.float32)
    calls: list[int] = []
    out = session(max_batch=3, calls=calls).run(["logits"], {"x": x})[0]
    assert calls == [3, 3, 1]
    np.testing.assert_allclose(out, x @ WEIGHTS.numpy(), rtol=1e-6)
    assert session().get_inputs()[0].name == "x"


def test_an_empty_batch_answers_nothing_of_the_right_width():
    out = session().run(["logits"], {"x": np.zeros((0, 4), np.float32)})[0]
    assert out.shape == (0, 3)


def info(**changes) -> prg.ProgramInfo:
    fields = {
        "format": "aoti",
        "precision": "fp32",
        "torch": torch.__version__,
        "cpu_capability": prg.cpu_capability(),
        "machine": platform.machine(),
    }
    return prg.ProgramInfo(**(fields | changes))


def test_a_program_this_process_can_run_is_not_refused():
    assert prg.refusal("model.pt2", info()) is None
    assert prg.refusal("model.pt2", info(torch=torch.__version__.split("+")[0] + "+cu128")) is None
    assert prg.refusal("model.pt2", info(cpu_capability="DEFAULT")) is None  # a lower level runs


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"torch": "2.0.1"}, r"model\.pt2: built by torch 2\.0\.1, this process has torch "),
        ({"machine": "riscv64"}, r"model\.pt2: compiled for riscv64, this machine is "),
        ({"cpu_capability": "ZVECTOR"}, r"model\.pt2: compiled for CPU capability ZVECTOR, "),
    ],
)
def test_a_program_built_elsewhere_is_refused_in_one_line(changes, why):
    import re

    message = prg.refusal("model.pt2", info(**changes))
    assert message is not None and re.match(why, message) and "\n" not in message


def test_a_cpu_below_the_programs_capability_is_refused():
    assert prg._covers("AVX512", "AVX2") and not prg._covers("AVX2", "AVX512")
    assert not prg._covers("AVX512", "SVE256")  # another family: never assumed to run
