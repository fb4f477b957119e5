"""The CPU half of the differential fuzzer (tests/fuzz): its configurations are reproducible,
cover the contract, and the validation decides each one as the fuzzer expects: a valid
configuration passes every check (also the exhaustive one) up to the device check, which comes
last, and a planted violation is refused naming a list, count, shape or page argument."""

import collections

import pytest
import torch

from flash_attn_sparse import SparseInputError
from fuzz import run, space
from fuzz.build import Case
from fuzz.run import compare

DEVICE_REFUSAL = "q: must be on a CUDA device, got cpu"
SEED = 20261201


@pytest.fixture(scope="module")
def configs():
    return [space.draw(SEED, i) for i in range(1000)]


def test_a_seed_and_index_give_the_same_configuration():
    for i in range(0, 400, 7):
        assert space.draw(3, i) == space.draw(3, i)
    assert [space.draw(3, i) for i in range(50)] != [space.draw(4, i) for i in range(50)]


def test_the_configurations_cover_the_contract(configs):
    seen = collections.defaultdict(set)
    for c in configs:
        seen["form"].add(c.form)
        seen["dtype"].add(c.dtype)
        seen["block"].add(c.block_size)
        seen["bad"].add(c.bad)
        seen["splits"].add(min(c.num_splits, 2))
        seen["causal"].add(c.causal)
        seen["validate"].add(c.validate)
        seen["group"].add(c.group)
        seen["graph"].add(c.graph)
        seen["poison"].add(c.poison[0] if c.poison else None)
        if c.form in ("blocks", "varlen", "paged"):
            seen["table heads"].add("1" if c.table_heads == 1 else "hk" if c.table_heads == c.heads_k else "h")
            seen["mask lists"].add(c.mask is not None)
            seen["seqused"].add(c.seqused_k is not None)
            seen["q tile"].add(c.q_block_size)
        if c.form == "paged":
            seen["page vs block"].add((c.page_size > c.block_size) - (c.page_size < c.block_size))
        if c.form == "varlen":
            seen["empty sequence"].add(0 in c.seqlens_q or 0 in c.seqlens_k)
            seen["sq != sk"].add(c.seqlens_q != c.seqlens_k)
        rows = [row for per_b in c.full for per_h in per_b for row in per_h]
        seen["empty row"].add(any(not row for row in rows))
        tail = space.cdiv(c.effective_seqlens_k()[0], c.block_size) - 1
        seen["tail first"].add(any(row and row[0] == tail and len(row) > 1 for row in rows))
    assert seen["form"] == set(space.FORMS)
    assert seen["dtype"] == {"bf16", "fp16"} and seen["block"] == set(space.BLOCK_SIZES)
    assert seen["bad"] == {None, *space.SKIPPED_BAD, *space.UNDEFINED_BAD, *space.SHAPE_BAD, space.PAGE_BAD}
    assert seen["splits"] == {0, 1, 2} and seen["causal"] == {True, False}
    assert seen["validate"] == {"cheap", "full"} and {1, 3, 8} <= seen["group"]
    assert seen["graph"] == {True, False} and seen["poison"] == {None, "q", "k", "v"}
    assert seen["table heads"] == {"1", "hk", "h"} and seen["mask lists"] == seen["seqused"] == {True, False}
    assert {None, 64, 128, 192, 256} <= seen["q tile"] and seen["page vs block"] == {-1, 0, 1}
    assert seen["empty sequence"] == seen["sq != sk"] == seen["empty row"] == seen["tail first"] == {True, False}


def test_the_space_draws_more_tiles_than_sms_with_skewed_lists(configs):
    """Some configurations have more kernel tiles of 128 rows than an H100 has SMs, so that FA-3's
    persistent CTAs run several each, and list lengths that differ across tiles, empty ones beside
    long ones: batched and varlen, causal and not, every table extent, split and not."""
    many = [c for c in configs if c.many_tiles]
    assert len(many) >= 20
    seen = collections.defaultdict(set)
    for c in many:
        assert c.block_size == 128 and space.kernel_tiles(c) > space.SMS, c.index
        lengths = [len(row) for per_b in c.full for per_h in per_b for row in per_h]
        assert 0 in lengths and max(lengths) >= 7 and len(set(lengths)) >= 4, (c.index, sorted(set(lengths)))
        seen["long"].add(max(lengths) >= 33)
        seen["form"].add(c.form)
        seen["causal"].add(c.causal)
        seen["table heads"].add("1" if c.table_heads == 1 else "hk" if c.table_heads == c.heads_k else "h")
        seen["splits"].add(min(c.num_splits, 2))
        if c.form == "varlen":
            seen["empty sequence"].add(0 in c.seqlens_q)
    assert seen["long"] == seen["causal"] == seen["empty sequence"] == {True, False}
    assert seen["form"] == {"blocks", "varlen"} and seen["table heads"] == {"1", "hk", "h"} and seen["splits"] == {0, 1, 2}
    assert not any(c.many_tiles for c in space.sanitizer_subset(0, 120))


def test_many_tile_draws_leave_the_other_configurations_as_they_were():
    """A stream of its own decides which configurations are many-tile ones: every other
    configuration of a seed is the one drawn without them (a reproducer line stays valid)."""
    for i in range(300):
        c = space.draw(5, i)
        if c.many_tiles:
            continue
        share, space.MANY_TILES_SHARE = space.MANY_TILES_SHARE, 0.0
        try:
            assert space.draw(5, i) == c, i
        finally:
            space.MANY_TILES_SHARE = share


def refusal(c: space.Config) -> str:
    with pytest.raises(SparseInputError) as error:
        Case(c, SEED, device="cpu").call("fa2")
    return str(error.value)


def test_valid_configurations_pass_every_check_and_violations_are_refused(configs):
    """On CPU tensors the device check is the last: valid configurations reach it."""
    decided = collections.Counter()
    for c in configs[:200]:
        if c.form == "partials" and c.expect_refusal:
            continue  # each group is checked in turn: the device check of the first comes first
        message = refusal(c)
        if c.expect_refusal:
            assert message != DEVICE_REFUSAL, f"{c.index}: {c.bad} not refused"
        else:
            assert message == DEVICE_REFUSAL, f"{c.index} ({c.form}, bad={c.bad}): {message}"
        decided[c.expect_refusal] += 1
    assert decided[True] > 20 and decided[False] > 150


def test_the_sanitizer_subset_runs_its_violations_unvalidated():
    subset = space.sanitizer_subset(0, 120)
    assert all(c.validate == "cheap" and not c.expect_refusal for c in subset)
    assert {c.bad for c in subset} >= {*space.SKIPPED_BAD, space.PAGE_BAD}
    assert any(c.form == "varlen" and 0 in c.seqlens_q for c in subset)
    for c in subset[:20]:
        assert refusal(c) == DEVICE_REFUSAL


def test_the_reference_agrees_with_itself_and_the_comparison_catches_errors(configs):
    """The fp32 reference passes against the fp64 one; a perturbed row or a lost NaN does not."""
    checked = 0
    for c in configs:
        if not c.result_defined or c.form == "spec_gather" or c.batch * c.heads * max(c.seqlens_q) * max(c.seqlens_k) > 8000:
            continue
        case = Case(c, SEED, device="cpu")
        exact, low = case.reference(torch.float64), case.reference(case.dtype)
        out, lse = case.reference(torch.float32)
        assert compare((out.to(case.dtype), lse), exact, low, case.dtype) == "", c.index
        on_cpu = case.reference(torch.float64, on_cpu=True)  # the sanitizer subset's path
        assert torch.equal(on_cpu[0].nan_to_num(), exact[0].nan_to_num()) and torch.equal(on_cpu[1], exact[1])
        finite = torch.isfinite(exact[0]) & (exact[0].abs() > 0.1)
        if finite.any():
            bad = out.clone()
            bad[finite.nonzero()[0].unbind()] += 1.0
            assert compare((bad, lse), exact, low, case.dtype) != ""
            lost = out.clone()
            lost[finite.nonzero()[0].unbind()] = float("nan")
            assert "non-finite" in compare((lost, lse), exact, low, case.dtype)
        checked += 1
        if checked == 8:
            break
    assert checked == 8


def test_a_poisoned_value_must_reach_the_rows_that_see_it_and_may_reach_only_the_rows_that_read_it():
    """NaN in V at a key some rows see: their outputs must stay NaN (a swallowed NaN fails); a
    NaN in a row whose list names the block but whose mask hides the key passes (a kernel's
    P = 0 times a loaded NaN); a NaN in a row whose list does not name the block fails."""
    c = next(c for c in (space.draw(SEED, i, [64]) for i in range(4000))
             if c.form == "blocks" and c.causal and c.mask is not None and c.result_defined and c.table_heads == 1
             and c.batch * c.heads * max(c.seqlens_q) * max(c.seqlens_k) <= 20000 and c.seqlens_q[0] > 1
             and any(c.mask[0][0]) and c.poison is None and c.seqused_k is None)
    c.poison = ("v", "nan")
    case = Case(c, SEED, device="cpu")
    case.v.fill_(0.5)
    block = next(ids[0] for ids in c.mask[0][0] if ids)
    case.v[0, min((block + 1) * c.block_size, c.seqlens_k[0]) - 1, 0, 0] = float("nan")  # its last key
    exact, low = case.reference(torch.float64), case.reference(case.dtype)
    reach = case.non_finite_reach()
    assert 0 < int((~torch.isfinite(exact[0])).sum()) < int(reach[0].sum())  # some rows read the key but mask it
    assert compare(exact, exact, low, case.dtype, reach) == ""
    swallowed = exact[0].nan_to_num(0.5)
    assert "swallowed" in compare((swallowed, exact[1]), exact, low, case.dtype, reach)
    stray_in_reach = exact[0].masked_fill(reach[0], float("nan"))
    assert compare((stray_in_reach, exact[1]), exact, low, case.dtype, reach) == ""
    outside = ~reach[0] & torch.isfinite(exact[0])
    if outside.any():
        stray = exact[0].clone()
        stray[outside.nonzero()[0].unbind()] = float("nan")
        assert "no non-finite input reaches" in compare((stray, exact[1]), exact, low, case.dtype, reach)


class FakeCase:
    """A Case whose backends are scripted: each returns the reference, raises, or allocates an
    output buffer and then refuses."""

    def __init__(self, c, behaviour, route=("fa2", "scripted")):
        self.inner = Case(c, SEED, device="cpu")
        self.c, self.q, self.dtype = c, self.inner.q, self.inner.dtype
        self.behaviour, self._route = behaviour, route

    def dense_problem(self):
        return self.inner.dense_problem()

    def reference(self, dtype, on_cpu=False):
        return self.inner.reference(dtype, on_cpu)

    def non_finite_reach(self):
        return self.inner.non_finite_reach()

    def route(self):
        return self._route

    def call(self, backend):
        action = self.behaviour[backend]
        if action == "refuse":
            raise SparseInputError("backend: scripted refusal")
        if action == "late":
            torch.empty(self.q.shape, dtype=self.q.dtype)
            raise SparseInputError("q: refused after allocating the output")
        if action == "upstream":
            raise ValueError("Block sparse tensors must share the same m-block dimension.")
        out, lse = self.inner.reference(torch.float64)
        if action == "wrong":
            out = out + 1
        return out.to(self.dtype), lse.float()


def small_valid_config(configs):
    return next(c for c in configs if c.result_defined and c.form == "blocks" and not c.graph and c.poison is None
                and c.batch * c.heads * max(c.seqlens_q) * max(c.seqlens_k) < 20000)


@pytest.mark.parametrize("behaviour, route, expected", [
    ({"fa2": "ok", "fa4": "ok", "auto": "ok"}, ("fa4", "x"), {"fa2": "pass", "fa4": "pass", "auto": "pass"}),
    ({"fa2": "ok", "fa4": "refuse", "auto": "ok"}, ("fa2", "x"), {"fa2": "pass", "fa4": "refused", "auto": "pass"}),
    ({"fa2": "ok", "fa4": "refuse", "auto": "ok"}, ("fa4", "x"), {"fa4": "refused", "auto": "wrong"}),
    ({"fa2": "refuse", "fa4": "ok", "auto": "ok"}, ("fa4", "x"), {"fa2": "wrong"}),
    ({"fa2": "ok", "fa4": "upstream", "auto": "ok"}, ("fa2", "x"), {"fa4": "upstream"}),
    ({"fa2": "ok", "fa4": "late", "auto": "wrong"}, ("fa2", "x"), {"fa4": "wrong", "auto": "wrong"}),
])
def test_the_runner_classifies_each_run(configs, behaviour, route, expected):
    from fuzz.run import KernelCap, run_config
    outcomes = run_config(FakeCase(small_valid_config(configs), behaviour, route), ["fa2", "fa4", "auto"], KernelCap(4))
    assert {b: outcomes[b][0] for b in expected} == expected, outcomes


def test_violations_must_be_refused_and_the_kernel_cap_skips(configs):
    from fuzz.run import KernelCap, run_config
    bad = next(c for c in configs if c.expect_refusal and c.form == "blocks")
    outcomes = run_config(FakeCase(bad, {"fa2": "refuse", "fa4": "ok", "auto": "refuse"}), ["fa2", "fa4", "auto"],
                          KernelCap(0))
    assert outcomes["fa2"][0] == "refused" and outcomes["fa4"][0] == "skipped"
    outcomes = run_config(FakeCase(bad, {"fa2": "refuse", "fa4": "ok", "auto": "refuse"}), ["fa2", "fa4"], KernelCap(1))
    assert outcomes["fa4"][0] == "wrong"


def test_the_reach_of_a_poisoned_value_is_computed_for_every_form():
    """Case.non_finite_reach runs on every form that draws NaN / Inf (spec_gather's visibility is
    2-D) and holds the reference's own non-finite elements."""
    forms = set()
    for i in range(3000):
        c = space.draw(2, i, [64, 128])
        if (not c.poison or not c.result_defined or c.form in forms
                or c.batch * c.heads * max(c.seqlens_q) * max(c.seqlens_k) > 200000):
            continue
        case = Case(c, 2, device="cpu")
        exact, low = case.reference(torch.float64), case.reference(case.dtype)
        assert compare(exact, exact, low, case.dtype, case.non_finite_reach()) == "", (i, c.form)
        forms.add(c.form)
    assert "spec_gather" in forms and len(forms) >= 4, forms


def test_variants_change_one_field_each():
    """--vary: the drawn configuration first, then one copy per FIELD=VALUE, the rest untouched."""
    drawn = space.draw(3, 718, (64, 128))
    found = run.variants(drawn, ["num_splits=1", "seqused_k=None"])
    assert [label for label, _ in found] == ["", " [num_splits=1]", " [seqused_k=None]"]
    assert found[0][1] is drawn and found[1][1].num_splits == 1 and found[2][1].seqused_k is None
    assert found[1][1].full == drawn.full and found[2][1].num_splits == drawn.num_splits
