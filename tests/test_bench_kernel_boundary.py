"""The read kernel of scripts/bench_kernel_boundary.py reads every byte of a layer once in
every form it is timed in, and a barrier whose programs are not all resident gives up and
says so instead of hanging (through Triton's interpreter on the CPU, or on the GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.triton_target import CUDA, DEVICE, require_triton

require_triton()

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_kernel_boundary import _phased_read_kernel  # noqa: E402

# Uneven phases of multiples of 16 elements (as the kernel needs), none a multiple of the
# block or of the program count.
PHASE_ELEMENTS = (1008, 48, 4112)


def layer():
    edges = [0]
    for n in PHASE_ELEMENTS:
        edges.append(edges[-1] + n)
    x = torch.randn(edges[-1], device=DEVICE)
    return x, torch.tensor(edges, dtype=torch.int64, device=DEVICE)


def run(x, bounds, programs, phases, barrier, early, max_polls=1 << 20, before_wait=False):
    out = torch.zeros(programs, dtype=torch.float32, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    failed = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    _phased_read_kernel[(programs,)](x, bounds, out, count, failed, programs, PHASES=phases, BLOCK=64,
                                     BARRIER=barrier, EARLY=early, MAX_POLLS=max_polls, PDL=False,
                                     INTERPRET=not CUDA, EARLY_BEFORE_WAIT=before_wait)
    return out, count, failed


@pytest.mark.parametrize(("early", "before_wait"), [(0, False), (1, False), (2, False), (1, True)])
@pytest.mark.parametrize("programs", [1, 3])
def test_one_kernel_and_the_chain_read_every_byte_once(early, before_wait, programs):
    x, bounds = layer()
    out, _, failed = run(x, bounds, programs, len(PHASE_ELEMENTS), barrier=False, early=early,
                         before_wait=before_wait)
    assert out.sum().item() == pytest.approx(x.sum().item(), rel=1e-4, abs=1e-3)
    chained = sum(run(x, bounds[p:p + 2], programs, 1, barrier=False, early=early,
                      before_wait=before_wait)[0].sum().item()
                  for p in range(len(PHASE_ELEMENTS)))
    assert chained == pytest.approx(x.sum().item(), rel=1e-4, abs=1e-3)
    assert failed.item() == 0


@pytest.mark.parametrize("early", [0, 2])
def test_barriers_of_resident_programs_pass_and_count_every_program(early):
    x, bounds = layer()
    # On the interpreter's one program at a time, only one program is ever resident.
    programs = 4 if CUDA else 1
    out, count, failed = run(x, bounds, programs, len(PHASE_ELEMENTS), barrier=True, early=early)
    assert out.sum().item() == pytest.approx(x.sum().item(), rel=1e-4, abs=1e-3)
    assert failed.item() == 0
    assert count.item() == programs * (len(PHASE_ELEMENTS) - 1)


@pytest.mark.skipif(CUDA, reason="needs programs that run one at a time, as the interpreter runs them")
def test_a_barrier_waiting_on_a_program_that_never_runs_gives_up_and_says_so():
    x, bounds = layer()
    out, _, failed = run(x, bounds, 2, len(PHASE_ELEMENTS), barrier=True, early=0, max_polls=4)
    assert failed.item() > 0
