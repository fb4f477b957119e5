"""FP8 (e4m3) K/V on the fa3 backend against the bf16 sparse call and dense FA-3 FP8 over exactly
the listed keys, on the same lists, in one run on one GPU.

Each shape runs `--passes` times (the spread between passes is the noise). Rows per shape:
  bf16_sparse      fa3, bf16 q/k/v (the call FP8 replaces)
  fp8_sparse       fa3, e4m3 k/v with per-(batch, K/V head) descales, bf16 q quantized in the call
  fp8_sparse_q8    the same with q given in e4m3 (quantize_q once, outside the timing)
  fp8_dense_listed dense FA-3 FP8 (flash_attn_interface.flash_attn_func) over K/V gathered to the
                   listed keys, on fp8_sparse_q8's e4m3 inputs; causal shapes: non-causal over as
                   many keys as a tile's lists, as bench_sparse's fa3_dense_listed
Times are graph replays (ms, median), lists rotating past L2, plus eager ms and host us per call
(bench_sparse.eager_and_host). At non-causal shapes the run also checks accuracy: max |out - ref|
of fp8_sparse_q8 and fp8_dense_listed against an fp32 reference over the dequantized inputs,
their ratio (the contract: <= 1.5), and the bf16-vs-FP8 output difference.

    python benchmarks/bench_fp8.py [--shapes "Sq16,prefill"] [--passes 2] [--out DIR]   (writes fp8.json, fp8.md)
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sparse as bs  # noqa: E402
import flash_attn_sparse as fas  # noqa: E402
from flash_attn_sparse.fp8 import FP8_DTYPE, quantize_q  # noqa: E402
from flash_attn_sparse.reference import attention_ref, quantize_per_kv_head  # noqa: E402

SHAPES = [bs.Shape(f"decode B8 Sq{sq} H32/8 Sk32k", 8, sq, 32768, 32, 8, d) for sq in (16, 1) for d in (1 / 8, 1 / 16)] + \
         [bs.Shape("decode B1 Sq1 H32/8 Sk128k", 1, 1, 131072, 32, 8, d) for d in (1 / 8, 1 / 16)] + \
         [bs.Shape("prefill B1 S16k H32 full", 1, 16384, 16384, 32, 32, 1 / 4),
          bs.Shape("prefill B1 S16k H32 causal", 1, 16384, 16384, 32, 32, 1 / 4, causal=True)]


def gathered_e4m3(k8, v8, lists):
    """listed_kv on e4m3 tensors (gathered as bytes)."""
    k, v = bs.listed_kv(k8.view(torch.uint8), v8.view(torch.uint8), lists)
    return k.view(FP8_DTYPE), v.view(FP8_DTYPE)


def reference(q, k, v, scale):
    """fp32 attention of q (B, Sq, H, D) over all of k, v (B, Sk, Hk, D), a K/V head at a time
    (attention_ref's scores of a whole prefill call would not fit)."""
    group, every_key = q.shape[2] // k.shape[2], torch.ones((), dtype=torch.bool, device=q.device)
    return torch.cat([attention_ref(q[:, :, h * group:(h + 1) * group], k[:, :, h:h + 1], v[:, :, h:h + 1], every_key, scale,
                                    dtype=torch.float32)[0] for h in range(k.shape[2])], dim=2)


def bench_shape(shape, passes, rows):
    from flash_attn_interface import flash_attn_func
    q, k, v = bs.random_inputs(shape)
    k8, k_descale = quantize_per_kv_head(k)
    v8, v_descale = quantize_per_kv_head(v)
    q8, q_descale = quantize_q(q, shape.heads_k)
    list_sets = bs.rotated_list_sets(shape)
    blocks = [bs.to_blocks(lists, shape) for lists in list_sets]
    flops, _ = bs.counted_work(shape, list_sets[0])
    descales = dict(k_descale=k_descale, v_descale=v_descale)

    def sparse(qq, kk, vv, **options):
        return bs.rotating([lambda b=b: fas.flash_attn_with_sparse_block_table(qq, kk, vv, b, causal=shape.causal, backend="fa3",
                                                                              **options) for b in blocks])
    if shape.causal:  # as many keys as a tile's lists, non-causal: what a dense call over them costs
        counts = [round(bs.keys_per_tile(lists)) for lists in list_sets]
        dense = bs.rotating([lambda n=n: flash_attn_func(q8, k8[:, :n], v8[:, :n], q_descale=q_descale, num_splits=0, **descales)
                          for n in counts])
    else:
        listed = [gathered_e4m3(k8, v8, lists) for lists in list_sets]
        dense = bs.rotating([lambda kl=kl, vl=vl: flash_attn_func(q8, kl, vl, q_descale=q_descale, num_splits=0, **descales)
                          for kl, vl in listed])
    calls = {"bf16_sparse": sparse(q, k, v), "fp8_sparse": sparse(q, k8, v8, **descales),
             "fp8_sparse_q8": sparse(q8, k8, v8, q_descale=q_descale, **descales), "fp8_dense_listed": dense}
    for p in range(passes):
        for method, call in calls.items():
            call()
            ms, how = bs.timed(call)
            eager_ms, host_us, eager_how = bs.eager_and_host(call)
            rows.append(dict(shape=shape.name, density=shape.density, method=method, run=p + 1, ms=ms, eager_ms=eager_ms,
                             host_us=host_us, tflops=flops / (ms * 1e-3) / 1e12, note="; ".join(n for n in (how, eager_how) if n)))
            print(f"  pass {p + 1} {method:>17}: {ms:8.4f} ms  eager {eager_ms:8.4f} ms  host {host_us:6.1f} us  "
                  f"{rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)
    if shape.causal:
        return None
    # Accuracy over list set 0: both FP8 kernels against fp32 over the dequantized inputs.
    lists = list_sets[0]
    kl8, vl8 = gathered_e4m3(k8, v8, lists)
    group = shape.heads // shape.heads_k
    deq = lambda x8, d: x8.float() * d[:, None, :, None]  # noqa: E731
    qd = q8.float() * q_descale.repeat_interleave(group, dim=1)[:, None, :, None]
    ref = reference(qd, deq(kl8, k_descale), deq(vl8, v_descale), shape.head_dim ** -0.5)
    out_fp8 = fas.flash_attn_with_sparse_block_table(q8, k8, v8, blocks[0], backend="fa3", q_descale=q_descale, **descales)[0]
    out_dense = flash_attn_func(q8, kl8, vl8, q_descale=q_descale, num_splits=0, **descales)
    out_dense = out_dense[0] if isinstance(out_dense, tuple) else out_dense
    out_bf16 = fas.flash_attn_with_sparse_block_table(q, k, v, blocks[0], backend="fa3")[0]
    err_fp8, err_dense = (out_fp8.float() - ref).abs().max().item(), (out_dense.float() - ref).abs().max().item()
    accuracy = dict(shape=shape.name, density=shape.density, err_fp8_sparse=err_fp8, err_fp8_dense=err_dense,
                    ratio=err_fp8 / err_dense if err_dense else float("inf"),
                    bf16_vs_fp8=(out_bf16.float() - out_fp8.float()).abs().max().item())
    print(f"  accuracy: fp8 sparse {err_fp8:.3e}, dense FP8 {err_dense:.3e} (ratio {accuracy['ratio']:.2f}), "
          f"bf16 vs fp8 {accuracy['bf16_vs_fp8']:.3e}", flush=True)
    return accuracy


def summary(rows, accuracy):
    """Markdown: per shape the medians over passes and the ratios the FP8 targets read."""
    by = {}
    for r in rows:
        by.setdefault((r["shape"], r["density"]), {}).setdefault(r["method"], []).append(r)
    lines = ["| shape | density | bf16 sparse ms | fp8 sparse ms | fp8 q8 ms | dense FP8 ms | fp8/bf16 | fp8/dense | "
             "fp8 q8/dense | TFLOP/s fp8 (bf16, dense FP8) | eager fp8/dense | spread |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, density), m in by.items():
        med = {k: statistics.median(r["ms"] for r in v) for k, v in m.items()}
        eager = {k: statistics.median(r["eager_ms"] for r in v) for k, v in m.items()}
        tf = {k: statistics.median(r["tflops"] for r in v) for k, v in m.items()}
        spread = max((max(r["ms"] for r in v) - min(r["ms"] for r in v)) / med[k] for k, v in m.items())
        lines.append(f"| {name} | 1/{round(1 / density)} | {med['bf16_sparse']:.4f} | {med['fp8_sparse']:.4f} | "
                     f"{med['fp8_sparse_q8']:.4f} | {med['fp8_dense_listed']:.4f} | "
                     f"{med['fp8_sparse'] / med['bf16_sparse']:.3f} | {med['fp8_sparse'] / med['fp8_dense_listed']:.3f} | "
                     f"{med['fp8_sparse_q8'] / med['fp8_dense_listed']:.3f} | "
                     f"{tf['fp8_sparse']:.0f} ({tf['bf16_sparse']:.0f}, {tf['fp8_dense_listed']:.0f}) | "
                     f"{eager['fp8_sparse'] / eager['fp8_dense_listed']:.3f} | {spread:.3f} |")
    if accuracy:
        lines += ["", "| shape | density | max err fp8 sparse | max err dense FP8 | ratio | bf16 vs fp8 |", "|---|---|---|---|---|---|"]
        lines += [f"| {a['shape']} | 1/{round(1 / a['density'])} | {a['err_fp8_sparse']:.3e} | {a['err_fp8_dense']:.3e} | "
                  f"{a['ratio']:.2f} | {a['bf16_vs_fp8']:.3e} |" for a in accuracy]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help="comma-separated substrings of 'shape-name density' (default: all)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--out", type=Path, help="folder for fp8.json and fp8.md")
    args = parser.parse_args()
    parts = [p.strip() for p in args.shapes.split(",")] if args.shapes else None
    shapes = [s for s in SHAPES if parts is None or any(p in f"{s.name} {s.density:.4g}" for p in parts)]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows, accuracy = [], []
    for shape in shapes:
        print(f"{shape.name}, density {shape.density:.4g}", flush=True)
        if (acc := bench_shape(shape, args.passes, rows)) is not None:
            accuracy.append(acc)
    table = summary(rows, accuracy)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        commit, gpu, date = bs.source_commit(), torch.cuda.get_device_name(), time.strftime("%Y-%m-%d")
        (args.out / "fp8.json").write_text(json.dumps(dict(gpu=gpu, commit=commit, date=date, rows=rows, accuracy=accuracy), indent=1))
        (args.out / "fp8.md").write_text(f"# FP8 sparse on fa3: {gpu}, {date}, {commit}\n\n"
                                         f"`python benchmarks/bench_fp8.py --passes {args.passes}`\n\n{table}\n")


if __name__ == "__main__":
    main()
