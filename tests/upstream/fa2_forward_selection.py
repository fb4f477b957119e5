"""pytest plugin (-p fa2_forward_selection): keeps the tests of upstream flash-attn's
tests/test_flash_attn.py that the dev profile compiles and that run forward only: every
test_flash_attn_kvcache case, and test_flash_attn_varlen_causal over a paged cache (upstream
skips its backward there), at the compiled head dims (FA_UPSTREAM_HEAD_DIMS, default 64,128:
the dev build has no uneven head dims), without ALiBi or local windows (compiled out).
test_flash_attn_kvcache alone has ~25,000 such cases; as a gate it keeps those with seqlen_k up
to 2048 (the 20k / 128k references take most of the time) and seqlen_new == seqlen_q, and three
rotary forms (none, interleaved half, full): about 4,800 in all. FA_UPSTREAM_ALL=1 keeps every one."""

import json
import os

FORWARD_ONLY = {
    "test_flash_attn_kvcache": lambda params: True,
    "test_flash_attn_varlen_causal": lambda params: params.get("paged_kv_block_size") is not None,
}
COMPILED_OUT = {"alibi": True, "local": True}  # parameter values the dev build cannot run


def head_dims():
    return {int(d) for d in os.environ.get("FA_UPSTREAM_HEAD_DIMS", "64,128").split(",")}


def selected(name: str, params: dict) -> bool:
    rule = FORWARD_ONLY.get(name)
    if rule is None or not rule(params):
        return False
    if params.get("d") not in head_dims():
        return False
    if any(params.get(key) == value for key, value in COMPILED_OUT.items()):
        return False
    if params.get("dropout_p", 0.0) != 0.0 or params.get("softcap", 0.0) != 0.0:
        return False
    return os.environ.get("FA_UPSTREAM_ALL") == "1" or name != "test_flash_attn_kvcache" or gate_case(params)


GATE_ROTARY = {(0.0, False), (0.5, True), (1.0, False)}


def gate_case(params: dict) -> bool:
    return (params["seqlen_k"] <= 2048 and params["seqlen_new_eq_seqlen_q"]
            and (params["rotary_fraction"], params["rotary_interleaved"]) in GATE_ROTARY)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        (keep if selected(item.originalname, params) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
    log = os.environ.get("FA_UPSTREAM_SELECTION_LOG")
    if log:
        with open(log, "w") as f:
            json.dump([{"name": i.originalname, "params": {k: repr(v) for k, v in i.callspec.params.items()}}
                       for i in keep], f)
