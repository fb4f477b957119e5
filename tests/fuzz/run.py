"""Differential fuzzer of the sparse forward on a GPU: every backend against the reference.

    python tests/fuzz/run.py [--seed S] [--count N] [--budget-s T] [--backends fa2,fa4,auto]
                             [--only INDEX [--vary FIELD=VALUE ...]] [--sanitizer-subset]

Each configuration (space.draw(seed, index)) runs on every backend and on "auto", and each run is
classified: pass (FlashAttention's 2x rule against an fp64/fp32 reference, LSE too, non-finite
patterns equal), refused (SparseInputError before any sparse kernel or output buffer), wrong
(a wrong answer, a violation accepted, a valid call refused by FA-2 or auto, a refusal after a
launch, or auto choosing a backend that refuses), device fault, upstream exception (anything
else escaping), unchecked (ran on input whose answer is undefined: memory safety only) or
skipped (past the cap of FA-4 kernels to compile, --fa4-kernels). Prints the seed, per-backend counts, how many
configurations had more kernel tiles than SMs and list lengths skewed across tiles (Config.many_tiles), one reproducer line per failure
and the wall time; exits 1 on any failure. --sanitizer-subset runs space.sanitizer_subset instead (bad ids,
counts, page tables; varlen edges), unvalidated, for compute-sanitizer (tests/sanitize.py), with the
references computed on the CPU so that initcheck sees only the kernels under test.
"""

import argparse
import ast
import collections
import dataclasses
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flash_attn_sparse as fas  # noqa: E402
from flash_attn_sparse import SparseInputError  # noqa: E402
from flash_attn_sparse.backends import fa2_ops  # noqa: E402
from fuzz import space  # noqa: E402
from fuzz.build import Case  # noqa: E402

ROUNDING = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # half an ulp at 1
LSE_TOLERANCE = 1e-3  # relative to max(1, |lse|): fp32 accumulation and exp2 in the kernels
FP64_MAX_ELEMENTS = 1 << 26  # reference in fp64 below this many score x head-dim products, else fp32
SINGLE_PATH_FORMS = ("partials",)  # no backend argument: one run


class LaunchWatch(TorchDispatchMode):
    """Records whether a sparse custom op ran or an output-shaped buffer was allocated: a
    refusal must come before either (FA-4 allocates its output through torch too)."""

    def __init__(self, q):
        super().__init__()
        self.shape, self.dtype, self.launched = tuple(q.shape), q.dtype, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = func.name()
        allocation = name.startswith("aten::empty") or name.startswith("aten::new_empty")
        if name.startswith("flash_attn_sparse::") or (
                allocation and isinstance(result, torch.Tensor) and tuple(result.shape) == self.shape
                and result.dtype == self.dtype):
            self.launched.append(name)
        return result


def known_backends(requested):
    """The requested backends, plus "fa3" when the API knows it (asked through its refusal)."""
    backends = list(requested)
    if "fa3" not in backends:
        q = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)
        try:
            fas.choose_backend(q, q, q, torch.zeros(1, dtype=torch.int32), block_size=128, backend="fa3")
            backends.append("fa3")
        except SparseInputError as error:
            if not str(error).startswith("backend"):
                backends.append("fa3")
    return backends


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up run), its outputs poisoned, then replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fn()
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    return out, lse


def is_device_fault(error: Exception) -> bool:
    text = str(error)
    return any(s in text for s in ("illegal memory access", "CUDA error", "unspecified launch failure",
                                   "misaligned address", "device-side assert"))


def run_backend(case: Case, backend: str):
    """(kind, detail, (out, lse) or None): kind is "ran", "refused" or "fault" / "upstream"."""
    c = case.c
    watch = LaunchWatch(case.q)
    try:
        if c.graph:
            result = graphed(lambda: case.call(backend))
        else:
            with watch:
                result = case.call(backend)
        if case.q.is_cuda:
            torch.cuda.synchronize()
        return "ran", "", result
    except SparseInputError as error:
        if watch.launched:
            return "late_refusal", f"{error} (after {watch.launched[0]})", None
        return "refused", str(error), None
    except Exception as error:  # classified, never swallowed: reported as a failure
        kind = "fault" if is_device_fault(error) else "upstream"
        return kind, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", None


def compare(got, ref, low, dtype, reach=None) -> str:
    """'' if (out, lse) passes FlashAttention's 2x rule against ref (low: the reference in the
    input dtype), else why not. Every non-finite element of the reference's must be non-finite
    (no NaN swallowed); any other must lie in `reach` (Case.non_finite_reach: a kernel's P = 0
    times a loaded NaN), and is then left out of the error."""
    out, lse = got
    ref_out, ref_lse = ref
    low_out = low[0]
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        return f"shape {tuple(out.shape)}/{tuple(lse.shape)} != reference {tuple(ref_out.shape)}/{tuple(ref_lse.shape)}"
    out, lse, ref_out, ref_lse, low_out = (t.double() for t in (out, lse, ref_out, ref_lse, low_out))
    reach_out, reach_lse = reach if reach is not None else (torch.zeros_like(out, dtype=torch.bool),
                                                            torch.zeros_like(lse, dtype=torch.bool))
    finite = torch.isfinite(ref_out)
    if (swallowed := int((finite.logical_not() & torch.isfinite(out)).sum())):
        return f"{swallowed} output elements finite where the reference's are not (NaN / Inf swallowed)"
    if (stray := int((finite & torch.isfinite(out).logical_not() & reach_out.logical_not()).sum())):
        return f"{stray} output elements non-finite where no non-finite input reaches"
    finite &= torch.isfinite(out)
    nan_lse, nan_ref = torch.isnan(lse), torch.isnan(ref_lse)
    if ((nan_ref & ~nan_lse).any() or (nan_lse & ~nan_ref & ~reach_lse).any()
            or not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))):
        return "LSE NaN / -inf pattern differs from the reference's"
    if finite.any():
        err = (out - ref_out)[finite].abs().max().item()
        low_diff = (low_out - ref_out)[finite & torch.isfinite(low_out)].abs()
        low_err = low_diff.max().item() if low_diff.numel() else 0.0
        bound = 2 * low_err + ROUNDING[dtype] * max(1.0, ref_out[finite].abs().max().item())
        if err > bound:
            return f"output error {err:.3e} > 2 x {low_err:.3e} + rounding"
    lse_ok = torch.isfinite(ref_lse) & torch.isfinite(lse)
    if lse_ok.any():
        lse_err = ((lse - ref_lse).abs() / ref_lse.abs().clamp(min=1))[lse_ok].max().item()
        if lse_err > LSE_TOLERANCE:
            return f"LSE error {lse_err:.3e} > {LSE_TOLERANCE}"
    return ""


def judge(case: Case, backend: str, kind: str, detail: str, result, reference) -> tuple:
    """(outcome, why) of one run: pass / refused / unchecked / wrong / fault / upstream."""
    c = case.c
    if kind in ("fault", "upstream"):
        return kind, detail
    if kind == "late_refusal":
        return "wrong", f"refused after a launch: {detail}"
    if c.expect_refusal:
        return ("refused", detail) if kind == "refused" else ("wrong", f"accepted a contract violation ({c.bad})")
    if kind == "refused":
        if backend in ("fa2", "auto"):
            return "wrong", f"a valid call refused: {detail}"
        return "refused", detail
    if not c.result_defined:
        return "unchecked", "ran without fault (result undefined)"
    why = compare(result, *reference, case.dtype, case.non_finite_reach() if c.poison else None)
    return ("wrong", why) if why else ("pass", "")


def reference_of(case: Case, on_cpu: bool = False):
    q, k, _, visible, _ = case.dense_problem()
    work = visible.numel() * q.shape[-1]
    precise = torch.float64 if work <= FP64_MAX_ELEMENTS else torch.float32
    return case.reference(precise, on_cpu), case.reference(case.dtype, on_cpu)


class KernelCap:
    """At most `cap` distinct FA-4 kernel classes per run: FA-4 compiles each at first use (seconds
    apiece), the FA-2 kernels are compiled ahead. Runs past the cap are counted as skipped."""

    def __init__(self, cap: int):
        self.cap, self.seen = cap, set()

    @staticmethod
    def key(c: space.Config) -> tuple:
        table = "1" if c.table_heads == 1 else "hk" if c.table_heads == c.heads_k else "h"
        return (c.dtype, c.head_dim, c.block_size, c.group, table, c.causal, c.form, min(c.num_splits, 2),
                c.seqused_k is None, c.mask is None, c.q_block_size, c.graph)

    def allows(self, c: space.Config) -> bool:
        key = self.key(c)
        if key not in self.seen and len(self.seen) < self.cap:
            self.seen.add(key)
        return key in self.seen


def run_config(case: Case, backends, cap: KernelCap, reference_on_cpu: bool = False) -> dict:
    """{backend: (outcome, why)} of one configuration, with auto's choice checked."""
    c = case.c
    reference = reference_of(case, reference_on_cpu) if c.result_defined else None
    try:
        route, route_error = case.route(), None
    except SparseInputError as error:
        route, route_error = None, error
    outcomes = {}
    for backend in ["fa2"] if c.form in SINGLE_PATH_FORMS else backends:
        on_fa4 = backend == "fa4" or (backend == "auto" and (route is None or route[0] == "fa4"))
        if on_fa4 and not cap.allows(c):
            outcomes[backend] = ("skipped", "FA-4 kernel cap reached")
            continue
        outcomes[backend] = judge(case, backend, *run_backend(case, backend), reference)
    if outcomes.get("auto", ("",))[0] in ("pass", "unchecked") and c.form not in ("spec_gather", "spec_zero_copy"):
        if route_error is not None:
            outcomes["auto"] = ("wrong", f"choose_backend refused a call that ran: {route_error}")
        elif route is not None and outcomes.get(route[0], ("",))[0] == "refused":
            outcomes["auto"] = ("wrong", f"auto chose {route[0]} ({route[1]}), which refuses: {outcomes[route[0]][1]}")
    return outcomes


def variants(config: space.Config, changes: list) -> list:
    """[(label, config)]: the drawn configuration, then one copy per FIELD=VALUE change."""
    found = [("", config)]
    for change in changes:
        field, _, value = change.partition("=")
        found.append((f" [{field}={value}]", dataclasses.replace(config, **{field: ast.literal_eval(value)})))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop drawing after this many seconds")
    parser.add_argument("--backends", default="fa2,fa4,auto")
    parser.add_argument("--only", type=int, default=None, help="run configuration INDEX only (a reproducer)")
    parser.add_argument("--sanitizer-subset", action="store_true", help="the adversarial subset, for compute-sanitizer")
    parser.add_argument("--fa4-kernels", type=int, default=40, help="FA-4 kernel classes to compile (KernelCap)")
    parser.add_argument("--verbose", action="store_true", help="print every configuration")
    parser.add_argument("--vary", action="append", default=[], metavar="FIELD=VALUE",
                        help="with --only: then the same configuration with FIELD (a space.Config field) set to VALUE (a "
                             "Python literal), one variant per --vary, to narrow a failure down (e.g. num_splits=1)")
    args = parser.parse_args(argv)
    if args.vary and args.only is None:
        parser.error("--vary needs --only")
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    head_dims, _ = fa2_ops.compiled_head_dims()
    head_dims = [d for d in head_dims if d <= 256]
    backends = known_backends(args.backends.split(","))
    indices = [args.only] if args.only is not None else range(args.count)
    mode = " --sanitizer-subset" if args.sanitizer_subset else ""
    print(f"fuzz: seed {seed}, head dims {head_dims}, backends {','.join(backends)}{mode}", flush=True)
    start = time.monotonic()
    counts = collections.defaultdict(collections.Counter)
    failures, run, cap = [], 0, KernelCap(args.fa4_kernels)
    many_tiles = 0
    for index in indices:
        if time.monotonic() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s reached", flush=True)
            break
        drawn = space.draw(seed, index, head_dims, adversarial=args.sanitizer_subset)
        for variant, config in variants(drawn, args.vary):
            outcomes = run_config(Case(config, seed), backends, cap, reference_on_cpu=args.sanitizer_subset)
            run += 1
            many_tiles += config.many_tiles
            for backend, (outcome, why) in outcomes.items():
                counts[backend][outcome] += 1
                if outcome in ("wrong", "fault", "upstream"):
                    failures.append(f"{outcome} on {backend}: {config.form} bad={config.bad}{variant} -- {why}\n"
                                    f"    python tests/fuzz/run.py --seed {seed} --only {index}{mode}")
                if outcome == "fault":
                    print("\n".join(failures), flush=True)
                    print("device fault: the CUDA context is lost, stopping", flush=True)
                    return 2
            if args.verbose or args.only is not None:
                print(f"[{index}{variant}] {config}\n    {outcomes}", flush=True)
    wall = time.monotonic() - start
    print(f"configurations run: {run} in {wall:.1f} s (seed {seed})")
    print(f"  of more kernel tiles than {space.SMS} SMs, lists skewed across tiles: {many_tiles}")
    for backend, counter in counts.items():
        print(f"  {backend}: " + ", ".join(f"{k} {counter[k]}" for k in
                                           ("pass", "refused", "unchecked", "skipped", "wrong", "fault", "upstream")))
    print(f"FA-4 kernel classes used: {len(cap.seen)} of {cap.cap}")
    print(f"failures: {len(failures)}")
    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
