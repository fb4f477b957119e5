"""The Python <-> C++ seam: every rule written on both sides agrees, and the extension's sparse
forward is called by the names its binding declares (patch flash-attn/0005)."""

import inspect
import re
from pathlib import Path

import pytest

from flash_attn_sparse.backends import fa2_ops

ROOT = Path(__file__).parents[2]
OVERLAY = ROOT / "patches/overlay/flash-attn/csrc/flash_attn"
BINDINGS_PATCH = next((ROOT / "patches/flash-attn").glob("0005-*.patch"))


def _binding_names(function: str):
    """The py::arg names of m.def(function, ...) as patch 0005 adds it to flash_api.cpp."""
    text = BINDINGS_PATCH.read_text()
    match = re.search(rf'm\.def\("{function}",(.*?)\);\n', text.replace("\n+          ", " "), re.S)
    assert match, f"patch 0005 binds {function}"
    assert "py::kw_only()" in match.group(1), f"{function}'s arguments are keyword-only"
    return re.findall(r'py::arg\("(\w+)"\)', match.group(1))


def _declared_parameters(function: str):
    """The parameter names of `function` in flash_api_sparse.h, trailing underscores dropped."""
    header = (OVERLAY / "flash_api_sparse.h").read_text()
    signature = re.search(rf"\b{function}\((.*?)\);", header, re.S).group(1)
    return [re.sub(r"_$", "", p.split()[-1].lstrip("&")) for p in signature.split(",")]


@pytest.mark.parametrize("function, entry", [("sparse_fwd", "mha_fwd_sparse"), ("combine", "mha_combine")])
def test_binding_names_are_the_declared_parameters_in_order(function, entry):
    assert _binding_names(function) == _declared_parameters(entry)


def test_ops_pass_every_binding_argument_by_name():
    """Both custom ops hand the extension exactly the binding's names: their own arguments (named
    alike, `causal` as `is_causal`) plus out / the partials' slots."""
    names = set(_binding_names("sparse_fwd"))
    forward = fa2_ops._extension_args({name: name for name in inspect.signature(fa2_ops.sparse_fwd._init_fn).parameters})
    assert set(forward) | {"out_partial", "lse_partial", "partial_offset"} == names
    partial_params = inspect.signature(fa2_ops.sparse_fwd_partial._init_fn).parameters
    assert set(fa2_ops._extension_args({name: name for name in partial_params})) | (
        {"out_partial", "lse_partial", "partial_offset"} & set(partial_params)) == names


def test_rounded_head_dim_matches_the_cpp_rule():
    source = (OVERLAY / "flash_api_sparse.cpp").read_text()
    rule = re.search(r"int head_size_rounded\(int head_size\) \{ return round_multiple\(head_size, "
                     r"head_size <= (\d+) \? (\d+) : (\d+)\); \}", source)
    assert rule, "flash_api_sparse.cpp's head_size_rounded keeps its one-line form"
    limit, small, large = map(int, rule.groups())
    for head_dim in range(8, 257, 8):
        multiple = small if head_dim <= limit else large
        assert fa2_ops.head_dim_rounded(head_dim) == -(-head_dim // multiple) * multiple


def test_compiled_head_dims_are_head_dim_switch_kernels():
    """sparse_head_dims lists the kernels HEADDIM_SWITCH has; Python's HEAD_DIM_KERNELS are them."""
    source = (OVERLAY / "flash_api_sparse.cpp").read_text()
    body = re.search(r"sparse_head_dims\(\) \{(.*?)\n\}", source, re.S).group(1)
    assert tuple(map(int, re.findall(r"FLASHATTENTION_DISABLE_HDIM(\d+)", body))) == fa2_ops.HEAD_DIM_KERNELS
    assert tuple(map(int, re.findall(r"head_dims\.push_back\((\d+)\)", body))) == fa2_ops.HEAD_DIM_KERNELS


@pytest.mark.gpu
def test_extension_accepts_keywords_only_and_reports_head_dims():
    """On the built wheel: the binding refuses positional calls, and its head dims are kernels."""
    extension = fa2_ops._cuda_module()
    with pytest.raises(TypeError):
        extension.combine(None, None, None, None, None)
    head_dims, _ = fa2_ops.compiled_head_dims()
    assert head_dims and set(head_dims) <= set(fa2_ops.HEAD_DIM_KERNELS)


def test_decode_tile_rule_matches_sparse_decode_tile():
    """fa2.decode_tile is flash_sparse.h's sparse_decode_tile over (packed rows, list keys, CTAs):
    the same comparisons of the same quantities (the constants: test_split_heuristics.py)."""
    from flash_attn_sparse.backends import fa2
    header = (OVERLAY / "src/flash_sparse.h").read_text()
    body = re.search(r"inline bool sparse_decode_tile\(const Flash_fwd_params &params\) \{(.*?)\n\}", header, re.S).group(1)
    assert "if (params.seqlen_q * params.sparse_pack_gqa > kSparseDecodeBlockM) { return false; }" in body
    assert "const long ctas = long(params.b) * (params.h / params.sparse_pack_gqa);" in body
    assert "return list_keys >= kSparseDecodeMinListKeys && ctas * list_keys >= kSparseDecodeMinTotalKeys;" in body
    for rows, keys, ctas in [(16, 16384, 64), (17, 16384, 64), (16, 16383, 64), (16, 16384, 63), (1, 1 << 20, 1)]:
        expected = rows <= fa2.DECODE_KERNEL_ROWS and keys >= fa2.DECODE_MIN_LIST_KEYS and ctas * keys >= fa2.DECODE_MIN_TOTAL_KEYS
        assert fa2.decode_tile(rows, keys, ctas) == expected


def test_tile_keys_match_sparse_max_tile_keys():
    """fa2.tile_n of the 64-row kernel is flash_sparse.h's sparse_max_tile_keys."""
    from flash_attn_sparse.backends import fa2
    header = (OVERLAY / "src/flash_sparse.h").read_text()
    rule = re.search(r"sparse_max_tile_keys\(const int head_size\) \{ return head_size <= (\d+) \? (\d+) : "
                     r"\(head_size <= (\d+) \? (\d+) : (\d+)\); \}", header)
    first, small, second, middle, large = map(int, rule.groups())
    for head_dim in range(8, 257, 8):
        expected = small if head_dim <= first else (middle if head_dim <= second else large)
        assert fa2.tile_n(head_dim, decode=False) == expected


FA3_HOST = ROOT / "patches/overlay/flash-attn-3/hopper/flash_api_sparse.cpp"


def _fa3_schema_names(op: str):
    """The argument names of the op `op` in flash_api_sparse.cpp's TORCH_LIBRARY schema."""
    text = re.sub(r'"\s*\n\s*"', "", FA3_HOST.read_text())  # join the schema's string pieces
    schema = re.search(rf'm\.def\("{op}\((.*?)\) ->', text).group(1)
    return [part.split("=")[0].split()[-1] for part in schema.split(",") if part.strip() != "*"]


def _fa3_pybind_names(anchor: str):
    """The py::arg names after `anchor` (a binding's first line), up to the binding's end."""
    text = FA3_HOST.read_text()
    body = text[text.index(anchor):]
    end = min(i for i in (body.find(");"), body.find('.def("run"')) if i >= 0)
    return re.findall(r'py::arg\("(\w+)"\)', body[:end])


@pytest.mark.parametrize("anchor", ['m.def("fwd_into"', "py::init<"])
def test_fa3_eager_entry_points_take_the_op_fwd_outs_names_in_order(anchor):
    """flash_attn_3._C's fwd_into and SparseForward (pybind11) take fwd_out's arguments, named alike,
    so the launcher and the plan hand them the op's keyword set; SparseForward also graph_launch,
    last and false unless asked for (backends/fa3.planned asks by name)."""
    extra = ["graph_launch"] if anchor == "py::init<" else []
    assert _fa3_pybind_names(anchor) == _fa3_schema_names("fwd_out") + extra
    if extra:
        assert 'py::arg("graph_launch") = false' in FA3_HOST.read_text()
    assert _fa3_schema_names("fwd_out") == ["q", "k", "v", "out"] + [n for n in _fa3_schema_names("fwd") if n not in "qkv"]


def test_fa3_run_with_takes_the_op_fwd_outs_tensors_and_an_lse():
    """SparseForward.run_with (the one-shot launcher's call) names q, k, v, out and then fwd_out's
    list and offset tensors in fwd_out's order, then fwd_out's max_seqlen_q and max_seqlen_k (the
    new cu_seqlens' bound), an optional softmax_lse (default None: a new one), and last fwd_out's
    seqused_k, page_table and FP8 descales."""
    text = FA3_HOST.read_text()
    body = text[text.index('.def("run_with"'):]
    names = re.findall(r'py::arg\("(\w+)"\)', body[:body.index(");")])
    tensors = [n for n in _fa3_schema_names("fwd_out") if n not in ("q", "k", "v", "out")][:8]
    assert tensors[-1] == "cu_seqlens_k"
    maxima = [n for n in _fa3_schema_names("fwd_out") if n.startswith("max_seqlen")]
    assert maxima == ["max_seqlen_q", "max_seqlen_k"]
    last = _fa3_schema_names("fwd_out")[-5:]
    assert last == ["seqused_k", "page_table", "q_descale", "k_descale", "v_descale"]
    assert names == ["q", "k", "v", "out"] + tensors + maxima + ["softmax_lse"] + last
    assert 'py::arg("softmax_lse") = py::none()' in body[:body.index(");")]


def test_fa2_run_with_names_run_s_tensors_then_the_constructor_s_lists_in_order():
    """SparseForward.run_with (the fa2 one-shot launcher's call, by name) takes run's q, k, v, out
    and then the constructor's list, offset, seqused_k and page-table tensors in their order, as
    flash_api_sparse.h declares it and patch 0005 binds it, keyword-only."""
    text = BINDINGS_PATCH.read_text().replace("\n+             ", " ")
    body = text[text.index('.def("run_with", &FLASH_NAMESPACE::SparseForward::run_with'):]
    body = body[:body.index('.def("release_run_buffers"')]
    assert "py::kw_only()" in body
    bound = re.findall(r'py::arg\("(\w+)"\)', body)
    header = (OVERLAY / "flash_api_sparse.h").read_text()
    declared = [p.split()[-1].lstrip("&") for p in re.search(r"\brun_with\((.*?)\);", header, re.S).group(1).split(",")]
    lists = ["full_cnt", "full_idx", "mask_cnt", "mask_idx", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table",
             "cu_total_m_blocks", "cu_block_idx_offsets"]
    assert bound == declared == ["q", "k", "v", "out"] + lists
    constructor = re.search(r"\bSparseForward\((.*?)\);", header, re.S).group(1)
    assert [p.split()[-1].lstrip("&") for p in constructor.split(",")][4:14] == lists


def test_fa2_sparse_forward_binds_the_constructor_s_parameters_by_name_in_order():
    """SparseForward's constructor (patch 0005's py::init) names flash_api_sparse.h's parameters in
    their order, keyword-only, graph_launch last and false unless asked for (planned_forward asks
    for it by name only when true)."""
    text = BINDINGS_PATCH.read_text().replace("\n+             ", " ").replace("\n+                      ", " ")
    body = text[text.index('py::class_<FLASH_NAMESPACE::SparseForward>'):]
    body = body[:body.index('.def("run"')]
    assert "py::kw_only()" in body and 'py::arg("graph_launch") = false' in body
    bound = re.findall(r'py::arg\("(\w+)"\)', body)
    header = (OVERLAY / "flash_api_sparse.h").read_text()
    constructor = re.search(r"\bSparseForward\((.*?)\);", header, re.S).group(1)
    declared = [p.split("=")[0].split()[-1].lstrip("&") for p in constructor.split(",")]
    assert bound == declared and declared[-1] == "graph_launch"
