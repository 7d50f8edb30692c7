"""Triton multi-tensor Adam / Lion / LAMB under TRITON_INTERPRET=1 against float64 references.

Kernels are called directly on CPU tensors (the convention in ``triton_support``). Launches use
small chunks so that one call covers many programs, full chunks, masked tails and empty tensors.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from polyaccel.ops.reference import optimizers as ref
from polyaccel.plugins.cuda.kernels import chunk_table
from polyaccel.plugins.cuda.kernels import optimizers as K

ADAM_HP = dict(lr=3e-2, beta1=0.9, beta2=0.999, eps=1e-8)
# odd sizes, one exactly a chunk (64), one multi-chunk with a tail, empty ones, a single element
SIZES = [1, 33, 64, 0, 200, 7, 0, 129]


@pytest.fixture(autouse=True)
def _small_chunks():
    chunk_table.set_launch_config(32, 2, 1)  # 64 elements per program
    yield
    chunk_table.set_launch_config(None)


def _bound(want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|error| allowed vs float64: fp32 rounding, or one bf16/fp16 ulp (the interpreter truncates)."""
    mag = want.abs()
    if dtype == torch.float32:
        return mag * 2e-6 + 1e-7
    mant = 7 if dtype == torch.bfloat16 else 10
    ulp = 2.0 ** (torch.floor(torch.log2(mag.clamp_min(1e-30))) - mant)
    return ulp * 1.01 + 1e-6


def _check(got_lists, want_lists, names):
    for name, got_l, want_l in zip(names, got_lists, want_lists, strict=True):
        for i, (got, want) in enumerate(zip(got_l, want_l, strict=True)):
            assert got.shape == want.shape
            if got.numel() == 0:
                continue
            err = (got.double() - want).abs()
            bound = _bound(want, got.dtype)
            assert bool((err <= bound).all()), (
                f"{name}[{i}] ({got.dtype}): max excess {float((err - bound).max()):.3e}, "
                f"max error {float(err.max()):.3e}")


def _make(sizes, p_dtype, state_dtype, n_states, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(p_dtype) for n in sizes]
    grads = [torch.randn(n, generator=g).to(p_dtype) for n in sizes]
    states = [[torch.randn(n, generator=g).to(state_dtype) for n in sizes]]
    if n_states == 2:
        states.append([torch.rand(n, generator=g).to(state_dtype) for n in sizes])
    return [params, grads, *states]


def _f64(lists):
    return [[t.double() for t in lst] for lst in lists]


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
          (torch.bfloat16, torch.bfloat16)]


def _adam_cases():
    """Every flag combination in fp32; both weight-decay modes for each 16-bit layout."""
    f32 = DTYPES[0]
    cases = [(*f32, w, bc, sk) for w in (True, False) for bc in (True, False) for sk in ("int", "tensor")]
    cases += [(*dts, w, True, "tensor" if w else "int") for dts in DTYPES[1:] for w in (True, False)]
    return cases


@pytest.mark.parametrize("p_dtype,state_dtype,adam_w_mode,bias_correction,step_kind", _adam_cases())
def test_fused_adam_matches_float64_reference(p_dtype, state_dtype, adam_w_mode, bias_correction, step_kind):
    seed = zlib.crc32(f"{p_dtype}{state_dtype}{adam_w_mode}{bias_correction}{step_kind}".encode()) % 1000
    lists = _make(SIZES, p_dtype, state_dtype, 2, seed)
    want = _f64(lists)
    step = 7 if step_kind == "int" else torch.tensor(7.0)
    kw = dict(ADAM_HP, weight_decay=0.1, adam_w_mode=adam_w_mode, bias_correction=bias_correction)
    K.fused_adam(*lists, step=step, **kw)
    ref.fused_adam(*want, step=7, **kw)
    _check([lists[0], lists[2], lists[3]], [want[0], want[2], want[3]], ["params", "exp_avgs", "exp_avg_sqs"])


@pytest.mark.parametrize("step", [1, 1000, 1_000_000])
def test_adam_step_on_device_matches_host_step(step):
    """The in-kernel bias correction (device step) agrees with the host's float64 one."""
    a = _make([300, 5], torch.float32, torch.float32, 2, seed=step % 97)
    b = [[t.clone() for t in lst] for lst in a]
    want = _f64(a)
    K.fused_adam(*a, step=step, weight_decay=0.0, **ADAM_HP)
    K.fused_adam(*b, step=torch.tensor(step, dtype=torch.int64), weight_decay=0.0, **ADAM_HP)
    ref.fused_adam(*want, step=step, weight_decay=0.0, **ADAM_HP)
    _check([a[0], b[0]], [want[0], want[0]], ["host-step params", "device-step params"])


@pytest.mark.parametrize("p_dtype,state_dtype", DTYPES[:3])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_lion_matches_float64_reference(p_dtype, state_dtype, weight_decay):
    lists = _make(SIZES, p_dtype, state_dtype, 1, seed=11)
    lists[2][4][:10] = 0  # sign(0) = 0 where momentum and gradient are both zero
    lists[1][4][:10] = 0
    want = _f64(lists)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=weight_decay)
    K.fused_lion(*lists, **kw)
    ref.fused_lion(*want, **kw)
    _check([lists[0], lists[2]], [want[0], want[2]], ["params", "exp_avgs"])


@pytest.mark.parametrize("p_dtype,state_dtype,bias_correction,step_kind", [
    (torch.float32, torch.float32, True, "int"), (torch.float32, torch.float32, True, "tensor"),
    (torch.float32, torch.float32, False, "int"), (torch.float32, torch.float32, False, "tensor"),
    (torch.bfloat16, torch.float32, True, "tensor"), (torch.float16, torch.float32, False, "int")])
def test_fused_lamb_matches_float64_reference(p_dtype, state_dtype, bias_correction, step_kind):
    lists = _make(SIZES, p_dtype, state_dtype, 2, seed=5)
    lists[0][2].zero_()  # a zero weight: trust ratio 1
    want = _f64(lists)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.05, bias_correction=bias_correction,
              max_coeff=10.0, min_coeff=0.01)
    K.fused_lamb(*lists, step=3 if step_kind == "int" else torch.tensor(3), **kw)
    ref.fused_lamb(*want, step=3, **kw)
    _check([lists[0], lists[2], lists[3]], [want[0], want[2], want[3]], ["params", "exp_avgs", "exp_avg_sqs"])


@pytest.mark.parametrize("op", ["fused_adam", "fused_lion", "fused_lamb"])
def test_float64_params_keep_float64_math_beside_triton_ones(op):
    """float64 params (the op's contract: fp64 math) go to torch's kernels; the fp32 ones in the same call to Triton."""
    n_states = 1 if op == "fused_lion" else 2
    wide = _make([33, 0, 129], torch.float64, torch.float64, n_states, seed=21)
    narrow = _make([64, 7], torch.float32, torch.float32, n_states, seed=22)
    lists = [[*w, *n] for w, n in zip(wide, narrow, strict=True)]  # one call, both kinds
    want = [[t.clone() for t in lst] for lst in wide]
    want_narrow = _f64(narrow)
    kw = {"fused_adam": dict(ADAM_HP, weight_decay=0.1, step=3), "fused_lion": dict(lr=1e-2, beta1=0.9, beta2=0.99,
          weight_decay=0.1), "fused_lamb": dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.05,
                                                step=3)}[op]
    getattr(K, op)(*lists, **kw)
    getattr(ref, op)(*want, **kw)
    getattr(ref, op)(*want_narrow, **kw)
    for k in (0, *range(2, 2 + n_states)):
        for got, exp in zip(lists[k][:3], want[k], strict=True):
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-14)
    _check([lists[0][3:]], [want_narrow[0]], ["fp32 params"])


def test_lamb_trust_ratio_sums_more_chunks_than_one_reduction_block():
    """A tensor spanning > 128 programs exercises the reduction kernel's loop; clamping both ways."""
    chunk_table.set_launch_config(16, 1, 1)
    sizes = [16 * 130 + 5, 40, 40]
    lists = _make(sizes, torch.float32, torch.float32, 2, seed=3)
    lists[0][1].mul_(1e-4)  # tiny weights: ratio clamped to min_coeff
    lists[0][2].mul_(1e4)  # huge weights: ratio clamped to max_coeff
    want = _f64(lists)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0, step=2, max_coeff=10.0, min_coeff=0.01)
    K.fused_lamb(*lists, **kw)
    ref.fused_lamb(*want, **kw)
    _check([lists[0]], [want[0]], ["params"])


def test_many_tensors_one_launch_per_dtype_group(count_launches):
    sizes = [int(x) for x in torch.randint(0, 90, (60,), generator=torch.Generator().manual_seed(2))]
    lists = _make(sizes, torch.float32, torch.float32, 2, seed=4)
    # mix in bf16 params with fp32 state: a second dtype group, so exactly two launches
    bf = _make([17, 70], torch.bfloat16, torch.float32, 2, seed=9)
    lists = [a + b for a, b in zip(lists, bf, strict=True)]
    want = _f64(lists)
    launches = count_launches(K, "_adam_kernel")
    K.fused_adam(*lists, step=4, weight_decay=0.01, **ADAM_HP)
    ref.fused_adam(*want, step=4, weight_decay=0.01, **ADAM_HP)
    assert len(launches) == 2
    assert sum(g[0] for g in launches) == sum(math.ceil(n / 64) for n in sizes + [17, 70])
    _check([lists[0], lists[3]], [want[0], want[3]], ["params", "exp_avg_sqs"])


def test_empty_inputs_are_no_ops():
    K.fused_adam([], [], [], [], step=1, weight_decay=0.0, **ADAM_HP)
    e = [torch.empty(0)]
    K.fused_adam(e, [torch.empty(0)], [torch.empty(0)], [torch.empty(0)], step=1, weight_decay=0.0, **ADAM_HP)
    K.fused_lion([torch.empty(0)], [torch.empty(0)], [torch.empty(0)], lr=1e-3, beta1=0.9, beta2=0.99,
                 weight_decay=0.0)
    K.fused_lamb([torch.empty(0)], [torch.empty(0)], [torch.empty(0)], [torch.empty(0)], lr=1e-3, beta1=0.9,
                 beta2=0.999, eps=1e-6, weight_decay=0.0, step=1)


def test_unaligned_views_take_the_unaligned_path_and_stay_correct():
    base = [torch.randn(301) for _ in range(4)]
    lists = [[b[1:300]] for b in base]  # 4-byte offset: not 16-byte aligned
    lists[3][0].abs_()
    want = _f64(lists)
    K.fused_adam(*lists, step=2, weight_decay=0.0, **ADAM_HP)
    ref.fused_adam(*want, step=2, weight_decay=0.0, **ADAM_HP)
    table = chunk_table.table_for("fused_adam", lists)
    assert table.groups[0].aligned is False
    _check([lists[0]], [want[0]], ["params"])
    assert torch.equal(base[0][300:], base[0][300:])  # neighbours untouched (masked tail)


def test_table_is_cached_and_reused_in_place():
    lists = _make([100, 3], torch.float32, torch.float32, 2, seed=8)
    chunk_table.clear_cache()
    t1 = chunk_table.table_for("fused_adam", lists)
    t2 = chunk_table.table_for("fused_adam", lists)
    assert t1 is t2 and chunk_table.cache_size() == 1
    other = _make([100, 3], torch.float32, torch.float32, 2, seed=8)
    assert chunk_table.table_for("fused_adam", other) is not t1
    # two steps through the cached table equal two reference steps
    want = _f64(lists)
    for s in (1, 2):
        K.fused_adam(*lists, step=s, weight_decay=0.0, **ADAM_HP)
        ref.fused_adam(*want, step=s, weight_decay=0.0, **ADAM_HP)
    _check([lists[0]], [want[0]], ["params"])


def test_chunk_offsets_are_64_bit_beyond_2_to_the_31():
    class Big:
        """Stands in for a tensor of 3 * 2**30 elements (the table needs only address and size)."""

        def __init__(self, n, ptr):
            self._n, self._p = n, ptr

        def numel(self):
            return self._n

        def data_ptr(self):
            return self._p

    n = 3 * 2**30
    lists = [[Big(n, 1 << 40)], [Big(n, 2 << 40)]]
    grp = chunk_table._build_group(lists, [0], (torch.float32, torch.float32), torch.device("cpu"), (1024, 4, 4))
    assert grp.chunk_start.dtype == torch.int64 and grp.numels.dtype == torch.int64
    assert int(grp.chunk_start[-1]) == (n // 4096 - 1) * 4096 > 2**31
    assert grp.n_chunks == n // 4096 and int(grp.first_chunk[-1]) == grp.n_chunks


def test_bad_inputs_name_the_problem():
    p = [torch.randn(10)]
    with pytest.raises(ValueError, match="differ in length"):
        K.fused_adam(p, [], [], [], step=1, weight_decay=0.0, **ADAM_HP)
    with pytest.raises(TypeError, match=r"exp_avgs\[0\].*float64"):
        K.fused_adam(p, [torch.randn(10)], [torch.randn(10, dtype=torch.float64)], [torch.rand(10)], step=1,
                     weight_decay=0.0, **ADAM_HP)
    with pytest.raises(ValueError, match="step must be >= 1"):
        K.fused_adam(p, [torch.randn(10)], [torch.randn(10)], [torch.rand(10)], step=0, weight_decay=0.0,
                     **ADAM_HP)
    with pytest.raises(ValueError, match="min_coeff"):
        K.fused_lamb(p, [torch.randn(10)], [torch.randn(10)], [torch.rand(10)], lr=1e-3, beta1=0.9, beta2=0.99,
                     eps=1e-6, weight_decay=0.0, step=1, min_coeff=2.0, max_coeff=1.0)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    chunk_table.clear_cache()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        K.fused_adam([torch.randn(3)], [torch.randn(3)], [torch.randn(3)], [torch.rand(3)], step=1,
                     weight_decay=0.0, **ADAM_HP)


def _transposed(t):
    return t.t().contiguous().t()


def _strided_with_offset(t):
    """Same values in every other column of a bigger buffer, one row in."""
    big = torch.zeros(t.shape[0] + 1, 2 * t.shape[1])
    big[1:, ::2] = t
    return big[1:, ::2]


def _layout_lists(n_lists, seed):
    """Three entries: contiguous, then each operand in another layout (transposed, strided with an
    offset, an expanded read-only grad), then contiguous; with contiguous float64 oracle copies."""
    gen = torch.Generator().manual_seed(seed)
    lays = [_transposed, lambda t: t[:1].expand_as(t), _strided_with_offset, _transposed]
    got, want = [[] for _ in range(n_lists)], [[] for _ in range(n_lists)]
    for k, shape in enumerate([(3, 40), (33, 5), (70,)]):
        for li in range(n_lists):
            t = torch.randn(shape, generator=gen) * (1.0, 0.5, 0.1, 0.01)[li]
            t = t.abs() if li == 3 else t
            t = lays[li](t) if k == 1 else t
            got[li].append(t)
            want[li].append(t.to(torch.float64, copy=True).contiguous())
    return got, want


@pytest.mark.parametrize("op", ["fused_adam", "fused_lion", "fused_lamb"])
def test_non_contiguous_operands_are_staged_and_right(op):
    """Transposed / strided / offset / expanded operands: the kernel works on contiguous copies."""
    n = 3 if op == "fused_lion" else 4
    got, want = _layout_lists(n, seed=len(op))
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.05)
    if op != "fused_lion":
        hp.update(eps=1e-6, step=2)
    if op == "fused_lamb":
        hp.update(max_coeff=10.0, min_coeff=0.01)
    strides = [[t.stride() for t in lst] for lst in got]
    getattr(K, op)(*got, **hp)
    getattr(ref, op)(*want, **hp)
    assert [[t.stride() for t in lst] for lst in got] == strides, "results land in the caller's tensors"
    _check([got[0], *got[2:]], [want[0], *want[2:]], ["params", "exp_avgs", "exp_avg_sqs"][: n - 1])


def test_transposed_param_matches_torch_adamw():
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(40, 9, generator=gen)
    ours = p0.clone().t()
    m, v = torch.zeros(9, 40), torch.zeros(9, 40)
    theirs = torch.nn.Parameter(p0.double().t())
    opt = torch.optim.AdamW([theirs], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step in (1, 2, 3):
        g = torch.randn(9, 40, generator=gen)
        K.fused_adam([ours], [g], [m], [v], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step)
        theirs.grad = g.double()
        opt.step()
    _check([[ours]], [[theirs.detach()]], ["params"])


def test_a_call_that_fails_validation_writes_no_float64_entry_first():
    wide = [torch.randn(10, dtype=torch.float64) for _ in range(4)]
    before = [t.clone() for t in wide]
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        K.fused_adam([wide[0], torch.randn(4)], [wide[1], torch.randn(4)], [wide[2], torch.randn(4)],
                     [wide[3], torch.rand(4, dtype=torch.float64)], step=1, weight_decay=0.0, **ADAM_HP)
    assert all(torch.equal(a, b) for a, b in zip(wide, before, strict=True))
