"""elementwise.py: silu in calls whose threads' shares are whole vectors gives each row the bits of one thread's
call at any thread count. Threads past this machine's two cores cut the work as a bigger machine does (torch
splits by its thread count, not by the cores it finds), so 3 to 16 threads here are the CPUs users have."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.elementwise import GRAIN, VECTOR, calls, in_whole_vectors, shares

ROWS = range(1, 700)  # rows of SmolLM2's MLP width (1,536 features), as a pass of 1 to 699 tokens holds


@pytest.fixture
def restore_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("threads", [3, 5, 6, 7, 8, 16])
def test_silu_in_whole_vectors_gives_every_row_one_threads_bits(threads, dtype, restore_threads):
    """Each row count's silu equals, row for row, one thread's silu of all 699 rows. The control: torch's one
    call gives other bits for some row counts at 5 threads and up (in float32 and float64, where a scalar
    tail's silu differs in ~4% of inputs; in bfloat16 the rounding hid it in a million inputs)."""
    x = (4 * torch.randn(ROWS[-1], 1536, generator=torch.Generator().manual_seed(0))).to(dtype)
    torch.set_num_threads(1)
    expected = F.silu(x)
    torch.set_num_threads(threads)
    for m in ROWS:
        assert torch.equal(in_whole_vectors(torch._C._nn.silu, x[:m]), expected[:m]), m
    if threads >= 5 and dtype != torch.bfloat16:
        assert any(not torch.equal(F.silu(x[:m]), expected[:m]) for m in ROWS), "torch's cut kept whole vectors"


def test_on_one_and_two_threads_it_is_one_call():
    """At 1 and 2 threads a tensor of whole 128-element vectors is one call (the model's padding makes every
    pass's so: nothing is added where nothing needed mending)."""
    for threads in (1, 2):
        assert all(calls(128 * k, threads) == [(0, 128 * k)] for k in range(1, 5000, 7))


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 10**8), threads=st.integers(1, 256))
def test_the_calls_cover_the_tensor_and_no_share_ends_inside_a_vector(n, threads):
    """At most three calls, in order, covering every element once; each call's shares (ATen's cut of it)
    are whole vectors but the one that ends the tensor; a call of several shares starts on a whole GRAIN."""
    parts = calls(n, threads)
    assert 1 <= len(parts) <= 3 and parts[0][0] == 0 and parts[-1][1] == n
    assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))
    for a, b in parts:
        cut = shares(b - a, threads)
        assert cut[0][0] == 0 and cut[-1][1] == b - a and len(cut) <= threads
        assert all((hi - lo) % VECTOR == 0 for lo, hi in cut if a + hi < n)
        assert len(cut) == 1 or a % GRAIN == 0
