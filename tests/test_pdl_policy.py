"""Which steps launch their Triton kernels with programmatic dependent launch
(hybridd/kernels/pdl.py): not a step whose projections run on cuBLAS, nor any step of a
kernel set whose choices turn it off, and the choice is per thread, since the graph generator's capture thread and serving thread run steps of
different sizes at once. Checked on the CPU with a device index marked capable."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridd.kernels import pdl
from hybridd.kernels.choices import KernelChoices
from hybridd.kernels.selection import TritonKernels

GPU = torch.device("cuda", 0)


@pytest.fixture
def capable(monkeypatch):
    monkeypatch.setattr(pdl, "_INTERPRET", False)
    monkeypatch.setattr(pdl, "_capable", {0: True})


def _enabled_in_another_thread() -> bool:
    seen = []
    thread = threading.Thread(target=lambda: seen.append(pdl.enabled(GPU)))
    thread.start()
    thread.join()
    return seen[0]


def test_off_holds_for_its_thread_only_and_nests(capable):
    assert pdl.enabled(GPU)
    with pdl.off():
        assert not pdl.enabled(GPU)
        assert _enabled_in_another_thread()
        with pdl.off():
            assert not pdl.enabled(GPU)
        assert not pdl.enabled(GPU)
    assert pdl.enabled(GPU)


def test_a_step_past_the_skinny_rows_launches_without_pdl(capable):
    kernels = TritonKernels()
    with kernels.launches(kernels.skinny_rows):
        assert pdl.enabled(GPU)
    with kernels.launches(kernels.skinny_rows + 1):
        assert not pdl.enabled(GPU)
    assert pdl.enabled(GPU)


def test_choices_without_pdl_turn_it_off_for_every_step_and_the_lm_head(capable):
    kernels = TritonKernels(KernelChoices(pdl=False))
    for rows in (1, kernels.skinny_rows, kernels.skinny_rows + 1):
        with kernels.launches(rows):
            assert not pdl.enabled(GPU), rows
    assert pdl.enabled(GPU)  # the choice holds inside its launches only: no global was set
    seen = []

    def recording_linear(x, weight, bias=None):
        seen.append(pdl.enabled(GPU))
        return x

    # What the projection sees of the policy when the kernel set calls it (the GPU tests
    # run the real one).
    kernels._gemm = type("RecordingGemm", (), {"linear": staticmethod(recording_linear)})
    kernels.linear(torch.zeros(4, 8), torch.zeros(8, 8))  # the LM head, outside a step's launches
    assert seen == [False]
    with_pdl = TritonKernels()
    with_pdl._gemm = kernels._gemm
    with_pdl.linear(torch.zeros(4, 8), torch.zeros(8, 8))
    assert seen == [False, True]
