"""Which steps launch their Triton kernels with programmatic dependent launch
(hybridd/kernels/pdl.py): not a step whose projections run on cuBLAS, and the choice is
per thread, since the graph generator's capture thread and serving thread run steps of
different sizes at once. Checked on the CPU with a device index marked capable."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridd.kernels import pdl
from hybridd.kernels.selection import TritonKernels

GPU = torch.device("cuda", 0)


@pytest.fixture
def capable(monkeypatch):
    monkeypatch.setattr(pdl, "_INTERPRET", False)
    monkeypatch.setattr(pdl, "_capable", {0: True})
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "CUBLAS_STEPS", False)


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


def test_cublas_steps_may_keep_pdl(capable, monkeypatch):
    monkeypatch.setattr(pdl, "CUBLAS_STEPS", True)
    with TritonKernels().launches(512):
        assert pdl.enabled(GPU)


def test_the_daemon_setting_still_turns_it_off_everywhere(capable, monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    with TritonKernels().launches(1):
        assert not pdl.enabled(GPU)
