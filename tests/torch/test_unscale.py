"""mpx_torch's unscale-and-check against torch._amp_foreach_non_finite_check_and_unscale_
on CPU tensors: the same bits, the same found_inf, in place; its diagnostics."""

import math
import pathlib
import re

import pytest
import torch

import mpx_torch
from support import AWKWARD, DTYPES, first_bit_mismatch, gradients, random_sizes

# GradScaler's inverse scales are powers of two; 0.003 is not, and its reciprocal's
# reciprocal is another float: mpx must multiply by the inv_scale given, as PyTorch does.
INV_SCALES = [2.0**-16, 0.003, 1.0]
LISTS = [[n] for n in AWKWARD] + [random_sizes(50, 7), random_sizes(13, 8) + AWKWARD]


def both(grads, inv):
    """Runs torch's op on clones and mpx's on the originals; returns (torch's grads,
    torch's found_inf, mpx's found_inf)."""
    theirs = [g.clone() for g in grads]
    found_theirs = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, torch.tensor([inv]))
    found_ours = torch.zeros(1)
    mpx_torch.non_finite_check_and_unscale_(grads, found_ours, torch.tensor([inv]))
    return theirs, found_theirs, found_ours


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inv", INV_SCALES)
@pytest.mark.parametrize("sizes", LISTS, ids=lambda s: f"{len(s)}x{s[0]}")
def test_unscaled_values_are_bit_equal_to_torch_and_written_in_place(dtype, inv, sizes):
    grads = gradients(sizes, dtype, seed=len(sizes) * 31 + sizes[0])
    pointers = [g.data_ptr() for g in grads]
    before = [g.clone() for g in grads]
    theirs, found_theirs, found_ours = both(grads, inv)
    assert found_theirs.item() == 0 and found_ours.item() == 0
    changed = False
    for i, (ours, ref) in enumerate(zip(grads, theirs)):
        assert ours.data_ptr() == pointers[i], f"gradient {i} was replaced, not modified in place"
        mismatch = first_bit_mismatch(ours, ref)
        assert mismatch is None, f"gradient {i} ({ours.numel()} elements): {mismatch}"
        changed = changed or not torch.equal(ours, before[i])
    assert changed == (inv != 1.0), "the gradients did not change (or changed under a scale of 1)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unscaled_values_equal_exact_products_rounded_to_float32_then_to_the_dtype(dtype):
    grads = gradients(random_sizes(20, 3) + AWKWARD, dtype, seed=11)
    expected = [(g.to(torch.float64) * torch.tensor(0.003, dtype=torch.float32).item()).to(torch.float32).to(dtype)
                for g in grads]
    mpx_torch.non_finite_check_and_unscale_(grads, torch.zeros(1), torch.tensor([0.003]))
    for i, (ours, ref) in enumerate(zip(grads, expected)):
        assert first_bit_mismatch(ours, ref) is None, f"gradient {i}: {first_bit_mismatch(ours, ref)}"


POISONS = [math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_found_inf_agrees_with_torch_wherever_inf_and_nan_are_planted(dtype):
    gen = torch.Generator().manual_seed(2024)
    planted_lists = 0
    for trial in range(60):
        count = 1 + int(torch.randint(0, 50, (1,), generator=gen))
        grads = gradients(random_sizes(count, 1000 + trial, largest=800) + ([65537] if trial % 10 == 0 else []),
                          dtype, seed=trial)
        names = [f"layer{i}.weight" for i in range(len(grads))]
        first = None
        if trial % 3:  # a third of the lists stay finite
            for _ in range(1 + int(torch.randint(0, 3, (1,), generator=gen))):
                i = int(torch.randint(0, len(grads), (1,), generator=gen))
                k = int(torch.randint(0, grads[i].numel(), (1,), generator=gen))
                grads[i][k] = POISONS[int(torch.randint(0, 3, (1,), generator=gen))]
                first = i if first is None else min(first, i)
            planted_lists += 1
        theirs = [g.clone() for g in grads]
        found_theirs = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, torch.tensor([2.0**-10]))
        found_ours = torch.zeros(1)
        report = mpx_torch.unscale_and_check_(grads, found_ours, torch.tensor([2.0**-10]), names=names)
        assert found_ours.item() == found_theirs.item() == (1.0 if first is not None else 0.0), f"trial {trial}"
        assert report.found_nonfinite == (first is not None)
        assert report.first_nonfinite == first, f"trial {trial}: {report}"
        assert report.first_nonfinite_name == (names[first] if first is not None else None)
        for i, (ours, ref) in enumerate(zip(grads, theirs)):
            finite = torch.isfinite(ref)
            assert torch.equal(torch.isfinite(ours), finite), f"trial {trial}, gradient {i}"
            assert torch.equal(torch.isnan(ours), torch.isnan(ref)), f"trial {trial}, gradient {i}"
            infinite = ~finite & ~torch.isnan(ref)
            assert torch.equal(ours[infinite], ref[infinite]), f"trial {trial}, gradient {i}: an inf lost its sign"
            assert first_bit_mismatch(ours[finite], ref[finite]) is None, f"trial {trial}, gradient {i}"
    assert planted_lists > 30


def test_found_inf_is_raised_never_cleared():
    found = torch.ones(1)
    mpx_torch.non_finite_check_and_unscale_([torch.ones(5)], found, torch.tensor([0.5]))
    assert found.item() == 1.0  # torch's op leaves a set flag set, so several calls accumulate
    found = torch.zeros(1)
    mpx_torch.non_finite_check_and_unscale_([torch.ones(5), torch.tensor([1.0, math.nan])], found, torch.tensor([1.0]))
    assert found.item() == 1.0


def test_overflow_when_unscaling_by_more_than_one_is_found_where_torch_misses_it():
    # The documented difference: torch checks the values before unscaling, mpx after, so
    # a finite float16 value that an inv_scale above 1 pushes past 65504 is reported.
    grads = [torch.tensor([40000.0, 1.0], dtype=torch.float16)]
    theirs, found_theirs, found_ours = both(grads, 2.0)
    assert math.isinf(theirs[0][0].item()) and found_theirs.item() == 0.0
    assert math.isinf(grads[0][0].item()) and found_ours.item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_report_norms_match_float64(dtype):
    grads = gradients(random_sizes(30, 5) + AWKWARD + [0], dtype, seed=5, spread=4)
    inv = 2.0**-3
    report = mpx_torch.unscale_and_check_(grads, torch.zeros(1), torch.tensor([inv]))
    expected = [float(g.to(torch.float64).norm()) for g in grads]  # of the values written back
    assert report.found_nonfinite is False and report.first_nonfinite is None
    assert len(report.norms) == len(grads)
    assert max(expected) > 0
    for i, (got, ref) in enumerate(zip(report.norms, expected)):
        assert abs(got - ref) <= 1e-5 * ref, f"gradient {i}: norm {got} vs float64 {ref}"
    total = math.sqrt(sum(x * x for x in expected))
    assert abs(report.norm - total) <= 1e-5 * total
    assert "35 gradients finite" in str(report)


def test_report_names_the_first_nonfinite_gradient():
    grads = [torch.ones(10), torch.ones(3, dtype=torch.float16), torch.ones(70000, dtype=torch.bfloat16)]
    grads[2][69999] = math.inf
    grads[1][2] = math.nan
    report = mpx_torch.unscale_and_check_(grads, torch.zeros(1), torch.tensor([1.0]),
                                          names=["fc1.weight", "fc1.bias", "fc2.weight"])
    assert report.first_nonfinite == 1 and report.first_nonfinite_name == "fc1.bias"
    assert math.isfinite(report.norms[0]) and not math.isfinite(report.norms[1]) and not math.isfinite(report.norms[2])
    assert "'fc1.bias' (gradient 1) is the first of 2" in str(report)


def test_empty_list_and_empty_tensors():
    found = torch.zeros(1)
    mpx_torch.non_finite_check_and_unscale_([], found, torch.tensor([0.5]))
    mpx_torch.non_finite_check_and_unscale_([torch.empty(0), torch.ones(3)], found, torch.tensor([0.5]))
    assert found.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn], ids=str)
def test_other_dtypes_are_refused_with_mpx_message(dtype):
    grads = [torch.ones(4), torch.zeros(4).to(dtype)]
    with pytest.raises(mpx_torch.Error, match=rf"mpx::unscale_and_check: gradient 1 is {dtype}; mpx handles"):
        mpx_torch.non_finite_check_and_unscale_(grads, torch.zeros(1), torch.tensor([0.5]))
    assert torch.equal(grads[0], torch.ones(4)), "nothing may change when a call is refused"
    assert issubclass(mpx_torch.Error, ValueError)


def test_the_refusal_docs_quote_is_the_message():
    """docs/pytorch.md quotes the float64 refusal word for word (up to the file and line)."""
    with pytest.raises(mpx_torch.Error) as refused:
        mpx_torch.non_finite_check_and_unscale_([torch.ones(4), torch.zeros(4, dtype=torch.float64)], torch.zeros(1),
                                                torch.tensor([0.5]))
    message = " ".join(str(refused.value).split(" (at ")[0].split())
    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "pytorch.md"
    assert message in re.sub(r"\s+", " ", doc.read_text()), f"docs/pytorch.md does not quote: {message}"


def test_bad_arguments_are_refused():
    with pytest.raises(mpx_torch.Error, match="found_inf must be a one-element torch.float32 tensor"):
        mpx_torch.non_finite_check_and_unscale_([torch.ones(2)], torch.zeros(1, dtype=torch.float64),
                                                torch.tensor([0.5]))
    with pytest.raises(mpx_torch.Error, match="gradient 0 is not contiguous"):
        mpx_torch.non_finite_check_and_unscale_([torch.ones(4, 4).t()], torch.zeros(1), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="2 names for 1 gradients"):
        mpx_torch.unscale_and_check_([torch.ones(2)], torch.zeros(1), torch.tensor([0.5]), names=["a", "b"])
