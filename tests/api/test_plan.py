"""Plan once, run many, on CPU tensors with the kernels faked: a SparsePlan validates
once and runs many; the one-shot entry points cache their decisions by shape; out= is checked.

The fake_gpu fixture lets CPU tensors past the CUDA-device check and records what would be
launched instead of launching it."""


import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks, SparseInputError, calls, interface
from flash_attn_sparse.backends import device, fa2, fa2_ops

PLANNED_FORWARD = fa2_ops.planned_forward  # the real one, before fake_gpu replaces it

B, SQ, SK, H, HK, D = 2, 1, 1024, 4, 2, 64


def qkv(seqlen_q=SQ, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, seqlen_q, H, D, generator=g).to(dtype)
    k = torch.randn(B, SK, HK, D, generator=g).to(dtype)
    return q, k, torch.randn_like(k)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Counts validations and records launches: validations, launches (op name, args)."""
    record = {"validations": 0, "launches": []}
    validate_blocks = calls.validate_blocks

    def counting_validate_blocks(*args, **kwargs):
        record["validations"] += 1
        return validate_blocks(*args, **kwargs)

    def fake_op(name):
        def launch(**args):
            record["launches"].append((name, args))
            q = args["q"]
            lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
            if name == "fwd":
                return torch.zeros_like(q), lse
            return lse
        return launch

    monkeypatch.setattr(calls, "validate_blocks", counting_validate_blocks)
    monkeypatch.setattr(calls, "require_cuda", lambda q: None)
    monkeypatch.setattr(fa2_ops, "compiled_head_dims", lambda: ((64, 128), False))
    monkeypatch.setattr(fa2, "num_sms", lambda index: 132)
    monkeypatch.setattr(fa2_ops, "sparse_fwd", fake_op("fwd"))
    monkeypatch.setattr(fa2_ops, "sparse_fwd_out", fake_op("fwd_out"))
    monkeypatch.setattr(fa2_ops, "launch_direct", lambda args, out: fake_op("direct")(**args, out=out))
    monkeypatch.setattr(fa2_ops, "planned_forward", lambda *args: None)  # a build without SparseForward
    monkeypatch.setattr(interface, "one_shot_cache", type(interface.one_shot_cache)())
    return record


def one_shot(q, k, v, table, **options):
    return fas.flash_attn_with_sparse_block_table(q, k, v, table, block_size=128, backend="fa2", **options)


def test_repeated_one_shot_calls_validate_once_and_launch_the_new_tensors(fake_gpu):
    q, k, v = qkv()
    one_shot(q, k, v, torch.tensor([0, 3, 5], dtype=torch.int32))
    q2, k2, v2 = qkv()
    table2 = torch.tensor([7, 1, 2], dtype=torch.int32)
    one_shot(q2, k2, v2, table2)
    assert fake_gpu["validations"] == 1
    (_, first), (_, second) = fake_gpu["launches"]
    assert second["q"] is q2 and second["k"] is k2 and second["v"] is v2
    assert second["full_idx"].data_ptr() == table2.data_ptr()
    assert {name: value for name, value in first.items() if not isinstance(value, torch.Tensor)} == \
           {name: value for name, value in second.items() if not isinstance(value, torch.Tensor)}
    entry, = interface.one_shot_cache.values()
    held = [value for part in (vars(entry), vars(entry.planned)) for value in part.values()]
    held += [value for value in held if isinstance(value, dict) for value in value.values()]
    assert not any(value is t for value in held for t in (q, k, v, q2, k2, v2, table2)), "the cache holds no caller tensor"


@pytest.mark.parametrize("change", ["seqlen_q", "dtype", "causal", "num_splits", "list capacity", "scale", "k strides"])
def test_the_cache_key_tells_shapes_and_options_apart(fake_gpu, change):
    q, k, v = qkv()
    table = torch.tensor([0, 3, 5], dtype=torch.int32)
    one_shot(q, k, v, table)
    options = {}
    if change == "seqlen_q":
        q, k, v = qkv(seqlen_q=2)
    elif change == "dtype":
        q, k, v = qkv(dtype=torch.bfloat16)
    elif change == "causal":
        options["causal"] = True
    elif change == "num_splits":
        options["num_splits"] = 3
    elif change == "list capacity":
        table = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    elif change == "scale":
        options["softmax_scale"] = 0.5
    else:
        k = torch.empty(B, HK, SK, D, dtype=k.dtype).transpose(1, 2).copy_(k)
    one_shot(q, k, v, table, **options)
    assert fake_gpu["validations"] == 2
    (_, first), (_, second) = fake_gpu["launches"]
    if change in ("causal", "num_splits", "scale"):
        name = {"causal": "is_causal", "num_splits": "num_splits", "scale": "softmax_scale"}[change]
        assert first[name] != second[name]


def test_exhaustive_validation_is_never_cached(fake_gpu):
    q, k, v = qkv()
    for _ in range(2):
        one_shot(q, k, v, torch.tensor([0, 3], dtype=torch.int32), validate="full")
    assert fake_gpu["validations"] == 2 and not interface.one_shot_cache


def test_a_cached_call_still_refuses_a_bad_out(fake_gpu):
    q, k, v = qkv()
    table = torch.tensor([0, 3], dtype=torch.int32)
    one_shot(q, k, v, table)
    with pytest.raises(SparseInputError, match=r"^out: must be like q"):
        one_shot(q, k, v, table, out=torch.empty(B, SQ, H, D, dtype=torch.bfloat16))


@pytest.mark.parametrize("bad", ["shape", "dtype", "last dim", "not a tensor"])
def test_out_is_checked_naming_out(fake_gpu, bad):
    q, k, v = qkv()
    out = {"shape": torch.empty(B, SQ + 1, H, D, dtype=q.dtype), "dtype": torch.empty_like(q, dtype=torch.float32),
           "last dim": torch.empty(B, SQ, H, D * 2, dtype=q.dtype)[..., ::2], "not a tensor": [1.0]}[bad]
    with pytest.raises(SparseInputError, match=r"^out: must (be|have)"):
        one_shot(q, k, v, torch.tensor([0, 3], dtype=torch.int32), out=out)
    plan = fas.SparsePlan(q, k, v, torch.tensor([0, 3], dtype=torch.int32), block_size=128, backend="fa2")
    with pytest.raises(SparseInputError, match=r"^out: must (be|have)"):
        plan.run(q, k, v, out=out)
    assert not fake_gpu["launches"]


def test_out_reaches_the_extension(fake_gpu):
    """An eager one-shot call launches the extension directly (the custom ops are what
    torch.compile traces), first call and cached ones alike, into the caller's out."""
    q, k, v = qkv()
    for _ in range(2):
        out = torch.empty_like(q)
        result, _ = one_shot(q, k, v, torch.tensor([0, 3], dtype=torch.int32), out=out)
        name, args = fake_gpu["launches"][-1]
        assert result is out and name == "direct" and args["out"] is out


def test_a_plan_validates_once_and_runs_the_callers_lists(fake_gpu):
    q, k, v = qkv()
    blocks = SparseBlocks(torch.full((B, HK, 1), 2, dtype=torch.int32),
                          torch.tensor([0, 3, 5, 1], dtype=torch.int32).expand(B, HK, 1, 4).contiguous(), block_size=128)
    seqused_k = torch.full((B,), SK, dtype=torch.int32)
    plan = fas.plan(q, k, v, blocks, backend="fa2", causal=True, seqused_k=seqused_k)
    assert plan.backend == "fa2" and fake_gpu["validations"] == 1
    runs = [qkv() for _ in range(3)]
    for q_i, k_i, v_i in runs:
        out, _ = plan.run(q_i, k_i, v_i)
        assert out is plan.out
    assert fake_gpu["validations"] == 1 and len(fake_gpu["launches"]) == 3
    for (q_i, k_i, v_i), (name, args) in zip(runs, fake_gpu["launches"]):
        assert name == "direct" and args["q"] is q_i and args["k"] is k_i and args["v"] is v_i
        assert args["full_cnt"] is blocks.full_cnt and args["full_idx"] is blocks.full_idx
        assert args["seqused_k"] is seqused_k and args["is_causal"] is True and args["out"] is plan.out
    given = torch.empty_like(q)
    assert plan.run(q, k, v, out=given)[0] is given


@pytest.mark.parametrize("other", ["q shape", "q dtype", "k strides", "v batch", "q not a tensor"])
def test_a_plan_refuses_other_tensors(fake_gpu, other):
    q, k, v = qkv()
    plan = fas.SparsePlan(q, k, v, torch.tensor([0, 3], dtype=torch.int32), block_size=128, backend="fa2")
    name = other[0]
    if other == "q shape":
        q = qkv(seqlen_q=2)[0]
    elif other == "q dtype":
        q = q.to(torch.bfloat16)
    elif other == "k strides":
        k = torch.empty(B, HK, SK, D, dtype=k.dtype).transpose(1, 2).copy_(k)
    elif other == "v batch":
        v = torch.cat([v, v])
    else:
        q = q.tolist()
    with pytest.raises(SparseInputError, match=rf"^{name}: "):
        plan.run(q, k, v)
    assert not fake_gpu["launches"]


def test_a_plan_refuses_a_non_contiguous_last_dim(fake_gpu):
    q, k, v = qkv()
    q = torch.empty(B, SQ, H, D * 2, dtype=q.dtype)[..., ::2]
    with pytest.raises(SparseInputError, match="^q: a plan runs tensors with a contiguous last dimension"):
        fas.SparsePlan(q, k, v, torch.tensor([0], dtype=torch.int32), block_size=128, backend="fa2")


def test_a_plan_is_validated_like_the_one_shot_call():
    q, k, v = qkv()
    with pytest.raises(SparseInputError, match="^q: must be on a CUDA device"):
        fas.SparsePlan(q, k, v, torch.tensor([0], dtype=torch.int32), block_size=128)
    with pytest.raises(SparseInputError, match="^blocks: "):
        fas.SparsePlan(q, k, v, torch.tensor([0], dtype=torch.int64), block_size=128)


def test_batch_one_lists_broadcast_on_the_cached_path_too(fake_gpu):
    q, k, v = qkv()
    blocks = SparseBlocks(torch.full((1, HK, 1), 2, dtype=torch.int32), torch.zeros(1, HK, 1, 3, dtype=torch.int32))
    for _ in range(2):
        fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa2")
    assert fake_gpu["validations"] == 1
    for _, args in fake_gpu["launches"]:
        assert args["full_cnt"].shape == (B, HK, 1) and args["full_cnt"].stride(0) == 0
        assert args["full_idx"].data_ptr() == blocks.full_idx.data_ptr()


def test_a_batched_fa4_plan_converts_its_lists_once_as_views(fake_gpu, monkeypatch):
    from flash_attn_sparse.backends import cute, fa4
    converted, launched = [], []

    def flash_attn_func(q, k, v, **arguments):
        launched.append((q, arguments))
        return torch.full_like(q, 2.0), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    flash_attn_4 = type("flash_attn_4", (), {"BlockSparseTensorsTorch": lambda **fields: converted.append(fields) or fields,
                                             "flash_attn_func": staticmethod(flash_attn_func)})
    for module in (cute, fa4):
        monkeypatch.setattr(module, "import_cute", lambda name: flash_attn_4, raising=False)
    monkeypatch.setattr(fa4, "refusal", lambda call: None)  # conftest keeps other tests on FA-2; no SM90 here
    monkeypatch.setattr(fa4, "num_sms", lambda index: 132)
    q, k, v = qkv()
    blocks = SparseBlocks(torch.full((B, HK, 1), 2, dtype=torch.int32), torch.zeros(B, HK, 1, 3, dtype=torch.int32))
    plan = fas.SparsePlan(q, k, v, blocks, backend="fa4")
    runs = [qkv() for _ in range(3)]
    for q_i, k_i, v_i in runs:
        out, _ = plan.run(q_i, k_i, v_i)
        assert out is plan.out and (out == 2).all()
    assert len(converted) == 1 and fake_gpu["validations"] == 1
    assert converted[0]["full_block_idx"].data_ptr() == blocks.full_idx.data_ptr()
    assert [q_i for q_i, _ in launched] == [q_i for q_i, _, _ in runs]
    assert all(arguments["block_sparse_tensors"] is converted[0] for _, arguments in launched)


def test_an_auto_plan_runs_the_same_launch_inside_and_outside_a_capture(fake_gpu, monkeypatch):
    """auto's choice does not depend on the stream: eager runs and captured ones launch alike."""
    q, k, v = qkv()
    blocks = SparseBlocks(torch.full((B, HK, 1), 2, dtype=torch.int32), torch.zeros(B, HK, 1, 3, dtype=torch.int32))
    plan = fas.SparsePlan(q, k, v, blocks)
    plan.run(q, k, v)
    eager = fake_gpu["launches"][-1][0]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    plan.run(q, k, v)
    assert fake_gpu["launches"][-1][0] == eager and not hasattr(plan, "eager_backend")


def test_the_engine_shaped_call_reaches_the_extension_with_its_pages_and_offsets(fake_gpu):
    """Varlen queries (a prefill chunk, a decode row, an empty sequence) over a paged cache with
    sparse lists and out=, one call: validated once, launched with page_table and cu_seqlens."""
    from flash_attn_sparse.metadata import pack_varlen_lists
    g = torch.Generator().manual_seed(3)
    seqlens_q, seqlens_k, page = [70, 1, 0], [300, 200, 0], 64
    q = torch.randn(sum(seqlens_q), H, D, generator=g).half()
    k = torch.randn(15, page, HK, D, generator=g).half()
    page_table = torch.randperm(15, generator=g).int().view(3, 5)  # permuted pages, 320 keys per row
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    blocks = pack_varlen_lists([[[[2, 0]] for _ in range(HK)], [[[1]] for _ in range(HK)], [[[]] for _ in range(HK)]],
                               None, 128, 128)
    out = torch.empty_like(q)
    for _ in range(2):
        result, _ = fas.flash_attn_varlen_with_sparse_blocks(
            q, k, torch.randn_like(k), blocks, cu_seqlens_q=cu(seqlens_q), cu_seqlens_k=cu(seqlens_k),
            max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), page_table=page_table, backend="fa2", out=out)
        assert result is out
    assert fake_gpu["validations"] == 1
    name, args = fake_gpu["launches"][-1]
    assert name == "direct" and args["page_table"] is page_table and args["cu_seqlens_k"] is not None
    assert args["max_seqlen_k"] == 300 and args["k"].shape == (15, page, HK, D)


def test_a_fa2_plan_runs_the_extensions_planned_forward(fake_gpu, monkeypatch):
    """With the extension's SparseForward, a plan hands it every argument once by name and each
    run passes only q, k, v and out; an out of other strides takes the direct launch."""
    made, runs = [], []

    class FakeSparseForward:
        """The extension's checks: run refuses tensors laid out otherwise than planned."""
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.planned = [(t.shape, t.stride(), t.dtype) for t in (kwargs["q"], kwargs["k"], kwargs["v"], kwargs["out"])]

        def run(self, q, k, v, out):
            if not all(isinstance(t, torch.Tensor) for t in (q, k, v, out)):
                raise TypeError("run(): incompatible function arguments")  # as pybind11 says it
            if [(t.shape, t.stride(), t.dtype) for t in (q, k, v, out)] != self.planned:
                raise RuntimeError("SparseForward.run: q, k, v and out must have the planned shapes and strides")
            runs.append((q, k, v, out))
            return torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(fa2_ops, "planned_forward", PLANNED_FORWARD)
    monkeypatch.setattr(fa2_ops, "_cuda_module", lambda: type("Extension", (), {"SparseForward": FakeSparseForward}))
    q, k, v = qkv()
    plan = fas.SparsePlan(q, k, v, torch.tensor([0, 3], dtype=torch.int32), block_size=128, backend="fa2")
    (args,) = made
    assert args["q"] is q and args["out"] is plan.out and "k_mask_source" not in args and args["num_splits"] >= 1
    q2, k2, v2 = qkv()
    out, _ = plan.run(q2, k2, v2)
    assert runs[-1] == (q2, k2, v2, plan.out) and out is plan.out
    strided = torch.empty(B, H, SQ, D, dtype=q.dtype).transpose(1, 2)
    plan.run(q2, k2, v2, out=strided)
    assert len(runs) == 1 and fake_gpu["launches"][-1][0] == "direct"
    with pytest.raises(SparseInputError, match="^q: the plan was made for shape"):
        plan.run(q2.to(torch.float64), k2, v2)  # the extension refuses it; the plan's own check names it
    with pytest.raises(SparseInputError, match="^k: must be a tensor"):
        plan.run(q2, None, v2)
    assert len(runs) == 1


def test_planned_forward_asks_for_a_graph_launch_by_name_only_when_wanted(monkeypatch):
    """graph_launch is passed by name only when true: asked for, or by default (device.GRAPH_LAUNCH,
    on) where the build's SparseForward names it in its signature; a build before it plans as ever.
    benchmarks/host_time.py's direct rows turn the switch off."""
    made = []

    class Planner:  # a pybind11 class's __init__ doc names its arguments
        def __init__(self, **kwargs):
            """__init__(self, q, k, v, out, ..., graph_launch: bool = False)"""
            made.append(kwargs)

    monkeypatch.setattr(fa2_ops, "_cuda_module", lambda: type("Extension", (), {"SparseForward": Planner}))
    args = {"k_mask_source": None, "v_mask_source": None, "num_splits": 2}
    PLANNED_FORWARD(args, "q", "k", "v", "out")
    PLANNED_FORWARD(args, "q", "k", "v", "out", graph_launch=False)
    assert made[0]["graph_launch"] is True and "graph_launch" not in made[1]
    assert made[0]["num_splits"] == made[1]["num_splits"] == 2 and "k_mask_source" not in made[0]
    monkeypatch.setattr(device, "GRAPH_LAUNCH", False)
    PLANNED_FORWARD(args, "q", "k", "v", "out")
    PLANNED_FORWARD(args, "q", "k", "v", "out", graph_launch=True)
    assert "graph_launch" not in made[2] and made[3]["graph_launch"] is True
    monkeypatch.setattr(device, "GRAPH_LAUNCH", True)
    Planner.__init__.__doc__ = "__init__(self, q, k, v, out, ...)"  # a build before graph_launch
    PLANNED_FORWARD(args, "q", "k", "v", "out")
    assert "graph_launch" not in made[4]


def test_a_fa3_plan_runs_the_extensions_planned_forward(fake_gpu, monkeypatch):
    """On fa3 a plan makes the op's SparseForward once with every argument by name (fwd_out's;
    graph_launch where the build takes it) and each run passes only q, k, v and out;
    an out of other strides goes through the extension's
    fwd_into (fwd_out's arguments by name) instead,
    and tensors the planned forward refuses are named by the plan's own check."""
    from flash_attn_sparse.backends import fa3, fa3_ops
    made, runs, outs = [], [], []

    class FakeSparseForward:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.planned = [(t.shape, t.stride(), t.dtype) for t in (kwargs["q"], kwargs["k"], kwargs["v"], kwargs["out"])]

        def run(self, q, k, v, out):
            if [(t.shape, t.stride(), t.dtype) for t in (q, k, v, out)] != self.planned:
                raise RuntimeError("SparseForward.run: q, k, v and out must have the planned shapes and strides")
            runs.append((q, k, v, out))
            return torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def fwd_into(*positional, **named):  # the extension's eager entry point: every argument by name
        assert not positional and set(made[0]) == set(named)
        outs.append(named["out"])
        q = named["q"]
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(fa3, "refusal", lambda call: None)  # no SM90 here
    monkeypatch.setattr(fa3_ops, "planner", lambda: FakeSparseForward)
    monkeypatch.setattr(fa3_ops, "direct", lambda: fwd_into)
    monkeypatch.setattr(fa3_ops, "op_out", lambda: None)
    monkeypatch.setattr(fa3_ops, "op", lambda: None)
    q, k, v = qkv()
    plan = fas.SparsePlan(q, k, v, torch.tensor([0, 3], dtype=torch.int32), block_size=128, backend="fa3", num_splits=2)
    (args,) = made
    assert args["out"] is plan.out and args["num_splits"] == 2 and args["full_idx"].shape[-1] == 2
    assert {"mask_cnt", "cu_seqlens_q", "softmax_scale", "q_block_size", "pack_gqa"} <= args.keys()
    q2, k2, v2 = qkv()
    out, _ = plan.run(q2, k2, v2)
    assert runs[-1] == (q2, k2, v2, plan.out) and out is plan.out
    strided = torch.empty(B, H, SQ, D, dtype=q.dtype).transpose(1, 2)
    result, _ = plan.run(q2, k2, v2, out=strided)
    assert result is strided and outs == [strided] and len(runs) == 1
    with pytest.raises(SparseInputError, match="^v: the plan was made for shape"):
        plan.run(q2, k2, v2[:, :7])
    assert "graph_launch" not in args  # this fake's signature does not name it: a build before it
    FakeSparseForward.__init__.__doc__ = "__init__(self, q, ..., graph_launch: bool = False)"
    fas.SparsePlan(q, k, v, torch.tensor([0, 3], dtype=torch.int32), block_size=128, backend="fa3", num_splits=2)
    assert made[-1]["graph_launch"] is True  # device.GRAPH_LAUNCH asks FA-3's SparseForward too


@pytest.mark.parametrize("with_run_with", [True, False])
def test_the_fa2_one_shot_cache_plans_once_and_passes_each_calls_lists_by_name(fake_gpu, monkeypatch, with_run_with):
    """With the extension's SparseForward.run_with, the one-shot cache's fa2 entry plans once (an
    out like q), drops run's buffers, and each call passes its tensors and lists by name and gets
    a new LSE back; a build without run_with launches through sparse_fwd as before."""
    made, runs = [], []

    class FakeSparseForward:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.released = False

        def run(self, q, k, v, out):
            raise AssertionError("the one-shot cache does not use run")

        def release_run_buffers(self):
            self.released = True

        def run_with(self, *positional, **named):
            assert self.released and not positional, "by name, after run's buffers were dropped"
            runs.append(named)
            q = named["q"]
            return torch.full((q.shape[0], q.shape[2], q.shape[1]), float(len(runs)))

    if not with_run_with:
        del FakeSparseForward.run_with
    monkeypatch.setattr(fa2_ops, "planned_forward", PLANNED_FORWARD)
    monkeypatch.setattr(fa2_ops, "_cuda_module", lambda: type("Extension", (), {"SparseForward": FakeSparseForward}))
    q, k, v = qkv()
    first, second = (torch.tensor(ids, dtype=torch.int32) for ids in ([0, 3], [5, 1]))
    out1, lse1 = one_shot(q, k, v, first)
    out2, lse2 = one_shot(q, k, v, second)
    assert len(made) == 1 and made[0]["out"].shape == q.shape and out1 is not out2
    if with_run_with:
        assert not fake_gpu["launches"] and len(runs) == 2
        assert bool((lse1 == 1).all()) and bool((lse2 == 2).all())
        assert set(runs[0]) == {"q", "k", "v", "out", "full_cnt", "full_idx", "mask_cnt", "mask_idx", "cu_seqlens_q",
                                "cu_seqlens_k", "seqused_k", "page_table", "cu_total_m_blocks", "cu_block_idx_offsets"}
        assert runs[0]["q"] is q and runs[1]["out"] is out2
        assert not torch.equal(runs[0]["full_idx"], runs[1]["full_idx"])  # each call's own lists
    else:
        assert not runs and [name for name, _ in fake_gpu["launches"]] == ["direct", "direct"]
