"""mpx_torch.Adam and AdamW against torch.optim.Adam and AdamW (fused=True, PyTorch's CPU
fused kernel) over several steps: float32 parameters directly; 16-bit parameters against
PyTorch run on float32 master copies; skipped steps; GradScaler; state dicts; refusals."""

import math

import pytest
import torch

import mpx_torch
from support import AWKWARD, DTYPES, gradients, random_sizes

# mpx's rule and PyTorch's fused kernel round differently (mpx: m += (1 - b1)(g - m) and a
# multiplication by 1 / sqrt(1 - b2^t); PyTorch: a lerp and a division), a few float32
# ulps per step; after the steps below the values agree to this.
RTOL, ATOL = 2e-6, 1e-7
# mpx holds the betas as float: its 1 - beta2 is 1 - fl(0.999) = 0.00099998713, 1.3e-5
# below PyTorch's (computed in double), and its second moments are smaller by that factor.
# The bias correction, from the same float beta2, cancels it in the update.
SECOND_MOMENT_RTOL = 2e-5
# The weight decay is a float exactly: mpx holds it as one, and where g + wd * w cancels
# (16-bit g and w make that happen), fl(0.05) and PyTorch's double 0.05 leave different
# remainders, which Adam's normalisation then blows up to a whole step.
HYPER = [dict(lr=1e-3), dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.03125)]
SIZES = AWKWARD + random_sizes(20, 21)


def close(ours, ref, what, rtol=RTOL, moment=False):
    """Elementwise within rtol; a moment (a sum of gradients of either sign, which cancel)
    within rtol of the tensor's largest element too."""
    ours, ref = ours.to(torch.float64).flatten(), ref.to(torch.float64).flatten()
    floor = rtol * float(ref.abs().max()) if moment else ATOL
    err = (ours - ref).abs() - (floor + rtol * ref.abs())
    i = int(err.argmax())
    assert err[i] <= 0, f"{what}: element {i}: {ours[i].item()!r} vs PyTorch {ref[i].item()!r}"


def make(kind, params, fused, **hyper):
    if fused:
        return getattr(torch.optim, kind)(params, fused=True, **hyper)
    return getattr(mpx_torch, kind)(params, **hyper)


def step_with(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
@pytest.mark.parametrize("hyper", HYPER, ids=["defaults", "tuned"])
def test_float32_parameters_follow_torch_fused(kind, hyper):
    init = gradients(SIZES, torch.float32, seed=1, spread=2)
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    a, b = make(kind, ours, False, **hyper), make(kind, theirs, True, **hyper)
    for step in range(6):
        grads = gradients(SIZES, torch.float32, seed=100 + step, spread=6)
        step_with(a, ours, grads)
        step_with(b, theirs, grads)
    moved = 0
    for i, (p, q) in enumerate(zip(ours, theirs)):
        close(p.detach(), q.detach(), f"parameter {i} ({p.numel()} elements)")
        close(a.state[p]["exp_avg"], b.state[q]["exp_avg"], f"first moment {i}", moment=True)
        close(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"], f"second moment {i}", SECOND_MOMENT_RTOL, moment=True)
        assert int(a.state[p]["step"]) == int(b.state[q]["step"]) == 6
        assert p.data_ptr() == ours[i].data_ptr()
        moved += int((p.detach() != init[i]).sum())
    assert moved > 0.9 * sum(SIZES)


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_parameters_follow_torch_on_float32_masters(kind, dtype):
    hyper = HYPER[1]
    init = gradients(SIZES, dtype, seed=2, spread=2)
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    masters = [torch.nn.Parameter(x.float()) for x in init]
    a, b = make(kind, ours, False, **hyper), make(kind, masters, True, **hyper)
    for step in range(5):
        grads = gradients(SIZES, dtype, seed=200 + step, spread=6)  # 16-bit, as autograd gives them
        step_with(a, ours, grads)
        step_with(b, masters, [g.float() for g in grads])
    for i, (p, q) in enumerate(zip(ours, masters)):
        master = a.state[p]["master"]
        assert master.dtype == torch.float32 and a.state[p]["exp_avg"].dtype == torch.float32
        close(master, q.detach(), f"master copy {i}")
        # The parameter is its master rounded once to the storage dtype.
        assert torch.equal(p.detach(), master.to(dtype)), f"parameter {i} is not its master rounded"
        assert not torch.equal(p.detach(), init[i]) or p.numel() == 1


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_found_inf_skips_the_step_and_grad_scale_unscales(kind):
    init = gradients([1000, 7, 1], torch.float32, seed=3, spread=2)
    half_init = [x.to(torch.bfloat16) for x in init]
    ours = [torch.nn.Parameter(x.clone()) for x in init] + [torch.nn.Parameter(half_init[0].clone())]
    theirs = [torch.nn.Parameter(x.clone()) for x in init] + [torch.nn.Parameter(half_init[0].float())]
    a, b = make(kind, ours, False, weight_decay=0.125), make(kind, theirs, True, weight_decay=0.125)
    scale = 1024.0
    for step, skip in enumerate([False, True, True, False, False]):
        grads = gradients([1000, 7, 1, 1000], torch.float32, seed=300 + step, spread=4)
        grads[3] = grads[3].to(torch.bfloat16)
        scaled = [g * scale for g in grads]
        before = [(p.detach().clone(), {k: v.clone() for k, v in a.state[p].items()}) for p in ours]
        for opt, params, gs in ((a, ours, scaled), (b, theirs, [g.float() for g in scaled])):
            opt.grad_scale = torch.tensor(scale)  # 0-d, as GradScaler hands them over
            opt.found_inf = torch.tensor(1.0 if skip else 0.0)
            step_with(opt, params, gs)
            del opt.grad_scale, opt.found_inf
        if skip:
            for i, p in enumerate(ours):
                assert torch.equal(p.detach(), before[i][0]), f"a skipped step changed parameter {i}"
                for key, value in before[i][1].items():
                    assert torch.equal(a.state[p][key], value), f"a skipped step changed {key} of parameter {i}"
    for i, (p, q) in enumerate(zip(ours, theirs)):
        close(a.state[p].get("master", p.detach()), q.detach(), f"parameter {i}")
        assert int(a.state[p]["step"]) == int(b.state[q]["step"]) == 3


def test_under_grad_scaler_a_model_trains_as_with_torch_fused_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.ReLU(), torch.nn.Linear(65, 7))
    twin = [p.detach().clone() for p in model.parameters()]
    ref = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.ReLU(), torch.nn.Linear(65, 7))
    with torch.no_grad():
        for p, q in zip(ref.parameters(), twin):
            p.copy_(q)
    data = torch.randn(12, 16, 33, generator=torch.Generator().manual_seed(1))
    target = torch.randn(12, 16, 7, generator=torch.Generator().manual_seed(2))
    data[4, 3, 5] = math.inf  # one batch overflows: both must skip it and halve the scale
    runs = []
    for net, opt in ((model, mpx_torch.AdamW(model.parameters(), lr=1e-2)),
                     (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True))):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        scales = []
        for x, y in zip(data, target):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append(scales)
    assert runs[0] == runs[1] and runs[0][4] == 2.0**11
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
        close(p.detach(), q.detach(), f"parameter {i}")
        assert not torch.equal(p.detach(), twin[i])


def test_a_parameter_without_gradient_keeps_its_own_step_count():
    init = gradients([50, 60, 70], torch.float32, seed=4, spread=1)
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    a, b = mpx_torch.Adam(ours), torch.optim.Adam(theirs, fused=True)
    for step in range(6):
        grads = gradients([50, 60, 70], torch.float32, seed=400 + step, spread=3)
        for params, opt in ((ours, a), (theirs, b)):
            opt.zero_grad()
            for i, (p, g) in enumerate(zip(params, grads)):
                if not (i == 1 and step in (2, 3)) and not (i == 2 and step == 0):
                    p.grad = g.clone()
            opt.step()
    assert [int(a.state[p]["step"]) for p in ours] == [6, 4, 5]
    for i, (p, q) in enumerate(zip(ours, theirs)):
        close(p.detach(), q.detach(), f"parameter {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_state_dict_round_trip_keeps_float32_state(dtype):
    init = gradients([300, 5], dtype, seed=6, spread=1)
    steps = [gradients([300, 5], dtype, seed=600 + k, spread=3) for k in range(4)]

    def run(params, opt, grads_list):
        for grads in grads_list:
            step_with(opt, params, grads)

    straight = [torch.nn.Parameter(x.clone()) for x in init]
    run(straight, opt := mpx_torch.AdamW(straight), steps)

    first = [torch.nn.Parameter(x.clone()) for x in init]
    run(first, saved := mpx_torch.AdamW(first), steps[:2])
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    again = mpx_torch.AdamW(resumed)
    again.load_state_dict(saved.state_dict())
    for p in resumed:
        assert again.state[p]["exp_avg"].dtype == torch.float32
        assert again.state[p]["step"].dtype == torch.int64
    assert again.state[resumed[0]]["step"] is again.state[resumed[1]]["step"]
    run(resumed, again, steps[2:])
    for p, q in zip(resumed, straight):
        assert torch.equal(p.detach(), q.detach())
        if dtype != torch.float32:
            assert torch.equal(again.state[p]["master"], opt.state[q]["master"])


def test_refusals_carry_mpx_messages():
    p = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(mpx_torch.Error, match=r"mpx::adam: beta1 and beta2 must lie in \[0, 1\)"):
        mpx_torch.Adam(p, betas=(1.0, 0.999))
    with pytest.raises(mpx_torch.Error, match="mpx::adamw: epsilon must be > 0"):
        mpx_torch.AdamW(p, eps=0.0)
    with pytest.raises(mpx_torch.Error, match="the learning rate must be finite and >= 0"):
        mpx_torch.Adam(p, lr=-1.0)
    with pytest.raises(ValueError, match="amsgrad is not supported"):
        mpx_torch.Adam(p, amsgrad=True)
    with pytest.raises(ValueError, match="maximize is not supported"):
        mpx_torch.AdamW(p, maximize=True)
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = mpx_torch.Adam([q])
    q.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(mpx_torch.Error, match="mpx::adam: parameter 0 is torch.float64; mpx handles"):
        opt.step()
    assert torch.equal(q.detach(), torch.ones(3, dtype=torch.float64))


def test_every_dtype_in_one_group_is_one_call_per_dtype():
    params = [torch.nn.Parameter(torch.full((n,), 0.5, dtype=d)) for d in DTYPES for n in (1, 7)]
    opt = mpx_torch.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    # The first Adam step moves every element by lr (m_hat / sqrt(v_hat) = 1), rounded to its dtype.
    for p in params:
        expected = torch.full(p.shape, 0.4).to(p.dtype).float()
        assert torch.allclose(p.detach().float(), expected, rtol=0, atol=1e-6), p
    assert len({id(opt.state[p]["step"]) for p in params}) == 1
