"""The TP slicing math: DeepSpeed's shard-size rule, slice/merge, JSON form (no engine needed)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_ext.errors import LayoutError
from deepspeed_ext.module_inject.layout import TPLayout, num_kv_heads_of, shard_sizes


# --------------------------------------------------------------------------- shard-size rule
def test_near_even_split_gives_extra_to_first_ranks():
    assert shard_sizes(10, 4) == (3, 3, 2, 2)  # not torch.chunk's 3, 3, 3, 1
    assert shard_sizes(101, 3, name="lm_head") == (34, 34, 33)
    assert shard_sizes(160, 3, name="model.layers.0.mlp.gate_proj") == (54, 53, 53)


def test_head_based_split_keeps_whole_kv_heads():
    # 6 KV heads of width 8 on 4 ranks: 2, 2, 1, 1 heads.
    assert shard_sizes(48, 4, name="attn.k_proj", num_kv_heads=6) == (16, 16, 8, 8)
    # q of 64 with 4 KV groups over 3 ranks: 2, 1, 1 groups.
    assert shard_sizes(64, 3, name="self_attn.q_proj", num_kv_heads=4) == (32, 16, 16)
    # Fewer heads than ranks: the last ranks get nothing.
    assert shard_sizes(16, 4, name="self_attn.k_proj", num_kv_heads=2) == (8, 8, 0, 0)


def test_head_rule_skips_mlp_and_output_head():
    assert shard_sizes(64, 3, name="model.layers.0.mlp.up_proj", num_kv_heads=4) == (22, 21, 21)
    assert shard_sizes(64, 3, name="lm_head", num_kv_heads=4) == (22, 21, 21)


def test_grain_remainder_goes_to_last_rank():
    # 70 = 8 grains of 8 + 6: grains 3, 3, 2 -> 24, 24, 16 + 6.
    assert shard_sizes(70, 3, grain=8) == (24, 24, 22)
    assert shard_sizes(5, 3, grain=8) == (2, 2, 1)  # smaller than one grain: plain near-even


def test_kv_heads_probe_order():
    assert num_kv_heads_of({"num_key_value_heads": 4, "num_attention_heads": 16}) == 4
    assert num_kv_heads_of({"num_attention_heads": 12}) == 12
    assert num_kv_heads_of({"text_config": {"num_kv_heads": 2}, "num_attention_heads": 8}) == 2
    assert num_kv_heads_of(None) is None


# --------------------------------------------------------------------------- worked example
def test_fused_qkv_rank_holds_its_piece_of_each_sub_param():
    """Worked example: q=64, kv=32 fused, TP=2 rank r holds cat(q_r, k_r, v_r)."""
    layout = TPLayout.sub_params((128, 4), 2, 0, (64, 32, 32), ((32, 32), (16, 16), (16, 16)), role="fused_qkv")
    full = torch.arange(128 * 4).reshape(128, 4)
    q, k, v = full[:64], full[64:96], full[96:]
    for r in range(2):
        expected = torch.cat([q[32 * r:32 * r + 32], k[16 * r:16 * r + 16], v[16 * r:16 * r + 16]])
        assert torch.equal(layout.slice(full, r), expected)
    assert torch.equal(layout.merge([layout.slice(full, r) for r in range(2)]), full)


def test_uneven_fused_qkv_tp3():
    widths = tuple(shard_sizes(s, 3, name="qkv_proj", num_kv_heads=4) for s in (64, 32, 32))
    assert widths == ((32, 16, 16), (16, 8, 8), (16, 8, 8))
    layout = TPLayout.sub_params((128, 4), 3, 0, (64, 32, 32), widths)
    assert [layout.local_shape(r) for r in range(3)] == [(64, 4), (32, 4), (32, 4)]


def test_row_split_and_replicated_bias():
    weight = TPLayout.split((4, 10), 4, 1, shard_sizes(10, 4), "row")
    full = torch.arange(40.).reshape(4, 10)
    assert torch.equal(weight.slice(full, 0), full[:, :3])
    assert torch.equal(weight.slice(full, 3), full[:, 8:])
    bias = TPLayout.replicated((4, ), 4)
    b = torch.arange(4.)
    assert bias.slice(b, 2) is b
    assert torch.equal(bias.merge([b.clone() for _ in range(4)]), b)


def test_replicas_that_differ_are_refused():
    bias = TPLayout.replicated((3, ), 2)
    with pytest.raises(LayoutError, match="differs between TP rank 0 and TP rank 1"):
        bias.merge([torch.zeros(3), torch.ones(3)])


def test_plain_slice_is_a_view():
    layout = TPLayout.split((8, 4), 2, 0, (4, 4), "column")
    full = torch.randn(8, 4)
    assert layout.slice(full, 1).data_ptr() == full[4:].data_ptr()


def test_bad_layouts_and_shapes_are_refused():
    with pytest.raises(LayoutError, match="do not tile"):
        TPLayout.split((10, 4), 2, 0, (6, 5), "column")
    with pytest.raises(LayoutError, match="out of range"):
        TPLayout.split((10, 4), 2, 0, (5, 5), "column").local_shape(2)
    layout = TPLayout.split((10, 4), 2, 0, (5, 5), "column")
    with pytest.raises(LayoutError, match="does not match layout shape"):
        layout.slice(torch.zeros(9, 4), 0)
    with pytest.raises(LayoutError, match="shard has shape"):
        layout.merge([torch.zeros(5, 4), torch.zeros(4, 4)])
    with pytest.raises(LayoutError, match="newer than"):
        TPLayout.from_json({**layout.to_json(), "version": 99})


def test_view_shape_split_of_stacked_experts():
    # 2 experts x 6 rows x 4 cols stored as (12, 4), split on the per-expert row dim.
    layout = TPLayout.sub_params((12, 4), 2, 1, (6, ), ((3, 3), ), view_shape=(2, 6, 4), role=None)
    full = torch.arange(48).reshape(12, 4)
    shard = layout.slice(full, 1)
    assert shard.shape == (6, 4)
    assert torch.equal(shard.reshape(2, 3, 4), full.reshape(2, 6, 4)[:, 3:])
    assert torch.equal(layout.merge([layout.slice(full, r) for r in range(2)]), full)


# --------------------------------------------------------------------------- properties
@st.composite
def layout_families(draw):
    """A function ``tp -> layout`` giving one tensor's layout at any TP degree (AutoTP's cutting rules)."""
    inner = draw(st.integers(1, 5))
    kind = draw(st.sampled_from(["column", "row", "gqa_qkv", "gate_up", "replicated", "expert_view"]))
    if kind == "replicated":
        rows = draw(st.integers(1, 40))
        return lambda tp: TPLayout.replicated((rows, inner), tp)
    if kind in ("column", "row"):
        total = draw(st.integers(0, 60))
        grain = draw(st.sampled_from([1, 1, 4, 8]))
        kv = draw(st.one_of(st.none(), st.integers(1, 8)))
        dim = 0 if kind == "column" else 1
        shape = [inner, inner]
        shape[dim] = total
        return lambda tp: TPLayout.split(shape, tp, dim, shard_sizes(total, tp, name="x", num_kv_heads=kv,
                                                                     grain=grain), kind)
    if kind == "gqa_qkv":
        kv_heads = draw(st.integers(1, 8))
        ratio = draw(st.integers(1, 4))  # query heads per KV head
        head_dim = draw(st.integers(1, 4))
        sizes = (kv_heads * ratio * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        return lambda tp: TPLayout.sub_params(
            (sum(sizes), inner), tp, 0, sizes,
            tuple(shard_sizes(s, tp, name="self_attn.qkv_proj", num_kv_heads=kv_heads) for s in sizes),
            role="fused_qkv")
    if kind == "gate_up":
        half = draw(st.integers(1, 40))
        return lambda tp: TPLayout.sub_params((2 * half, inner), tp, 0, (half, half),
                                              (shard_sizes(half, tp, name="mlp"), ) * 2, role="gate_up")
    experts, rows = draw(st.integers(1, 4)), draw(st.integers(1, 20))
    return lambda tp: TPLayout.sub_params((experts * rows, inner), tp, 1, (rows, ), (shard_sizes(rows, tp), ),
                                          view_shape=(experts, rows, inner), role=None)


@st.composite
def layouts(draw):
    return draw(layout_families())(draw(st.integers(1, 8)))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_split_then_merge_is_identity_and_covers_every_element_once(layout):
    full = torch.arange(layout.numel, dtype=torch.int64).reshape(layout.shape)
    shards = [layout.slice(full, r) for r in range(layout.tp_size)]
    for r, shard in enumerate(shards):
        assert tuple(shard.shape) == layout.local_shape(r)
    assert torch.equal(layout.merge(shards), full)
    if not layout.is_replicated:
        seen = torch.cat([s.reshape(-1) for s in shards]).sort().values
        assert torch.equal(seen, torch.arange(layout.numel))
        assert sum(math.prod(layout.local_shape(r)) for r in range(layout.tp_size)) == layout.numel


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_json_round_trip(layout):
    again = TPLayout.from_json(layout.to_json())
    assert again == layout
    assert again.to_json() == layout.to_json()


def _recording_reader(source: TPLayout, full: torch.Tensor, read: list[int]):
    """``read_flat`` for :meth:`TPLayout.reshard` over the saved shards of ``full``, recording each read's span."""
    shards = [source.slice(full, r).reshape(-1) for r in range(source.tp_size)]

    def read_flat(src, start, stop):
        read.append(stop - start)
        return shards[src][start:stop]

    return read_flat


def _rows_reader(source: TPLayout, full: torch.Tensor):
    """``read_rows`` for :meth:`TPLayout.reshard_range` over the saved shards of ``full``: a new tensor of the
    rows, as a copying reader returns them."""
    shards = [source.slice(full, r).reshape(-1) for r in range(source.tp_size)]

    def read_rows(src, start, count, stride, length):
        assert count > 1 and length < stride  # else reshard_range reads one flat span
        return torch.stack([shards[src][start + i * stride:start + i * stride + length] for i in range(count)])

    return read_rows


def _split_on_rows(source: TPLayout, target: TPLayout) -> bool:
    """Whether the split is on the outermost dimension, where a read spans no other rows than it uses."""
    if source.is_replicated and target.is_replicated:
        return True
    split = target if source.is_replicated else source
    return split.partition_dim == 0


@settings(max_examples=300, deadline=None)
@given(layout_families(), st.integers(1, 8), st.integers(1, 8), st.booleans())
def test_reshard_equals_slicing_the_full_tensor_and_reads_each_element_once(family, tp_from, tp_to,
                                                                           to_replicated):
    """Load-time resharding (saved at TP=tp_from, loaded at tp_to) gives exactly target.slice(full), and
    over all target ranks reads every element of the sharded source once: only the overlapping pieces."""
    source = family(tp_from)
    target = TPLayout.replicated(source.shape, tp_to) if to_replicated else family(tp_to)
    full = torch.arange(source.numel, dtype=torch.int64).reshape(source.shape)
    read: list[int] = []
    read_flat = _recording_reader(source, full, read)
    for rank in range(tp_to):
        got = source.reshard(target, rank, read_flat)
        assert tuple(got.shape) == target.local_shape(rank)
        assert torch.equal(got, target.slice(full, rank))
    if source.is_replicated:
        assert sum(read) == source.numel * tp_to  # TP rank 0's copy only
    elif not _split_on_rows(source, target):
        pass  # a split on an inner dimension reads the span of rows each piece's columns lie in
    elif not target.is_replicated:
        assert sum(read) == source.numel
    else:
        assert sum(read) == source.numel * tp_to


@settings(max_examples=300, deadline=None)
@given(layout_families(), st.integers(1, 8), st.integers(1, 8), st.integers(1, 5), st.booleans())
def test_a_zero3_partition_of_a_resharded_slice_reads_about_its_own_share(family, tp_from, tp_to, dp,
                                                                          from_universal):
    """``reshard_range`` gives each DP rank exactly its ZeRO-3 partition (ceil(numel / dp) elements, the last
    ones short or empty) of its new TP slice, from the saved TP shards or from the full tensor, and reads
    little more than that partition: at most one row at either end of each piece it reads."""
    source = TPLayout.replicated(family(1).shape, 1) if from_universal else family(tp_from)
    target = family(tp_to)
    full = torch.arange(source.numel, dtype=torch.int64).reshape(source.shape)
    for rank in range(tp_to):
        expected = target.slice(full, rank).reshape(-1)
        size = -(-expected.numel() // dp)
        for dp_rank in range(dp):
            low, high = min(dp_rank * size, expected.numel()), min((dp_rank + 1) * size, expected.numel())
            read: list[int] = []
            got = source.reshard_range(target, rank, low, high, _recording_reader(source, full, read))
            assert torch.equal(got, expected[low:high]), (rank, dp_rank)
            # The same with a strided reader (the restore's pread path): the same elements, fetched row by row.
            with_rows = source.reshard_range(target, rank, low, high, _recording_reader(source, full, []),
                                             _rows_reader(source, full))
            assert torch.equal(with_rows, expected[low:high]), (rank, dp_rank)
            if _split_on_rows(source, target) and target.view_shape is None:
                row = math.prod(target.shape[1:])
                assert sum(read) <= high - low + 2 * row * len(read), (rank, dp_rank, read)


def test_reshard_range_refuses_a_range_outside_the_shard():
    layout = TPLayout.split((8, 4), 2, 0, (4, 4), "column")
    with pytest.raises(LayoutError, match=r"range \[0, 17\) is outside TP rank 1's 16 elements"):
        layout.reshard_range(layout, 1, 0, 17, lambda *a: torch.empty(0))


def test_reshard_refuses_a_different_shape():
    source = TPLayout.split((8, 4), 2, 0, (4, 4), "column")
    with pytest.raises(LayoutError, match=r"saved shape \(8, 4\) does not match the model's \(6, 4\)"):
        source.reshard(TPLayout.split((6, 4), 2, 0, (3, 3), "column"), 0, lambda *a: None)


# --------------------------------------------------------------------------- whole-model geometry sweep
@st.composite
def model_geometries(draw):
    """A decoder's attention and MLP geometry, including fewer KV heads than TP ranks and widths that no TP
    degree divides."""
    return dict(kv_heads=draw(st.integers(1, 8)), group=draw(st.integers(1, 4)), head_dim=draw(st.integers(1, 6)),
                hidden=draw(st.integers(1, 12)), vocab=draw(st.integers(1, 131)), mlp=draw(st.integers(1, 70)))


def model_layouts(g: dict, tp: int) -> dict[str, TPLayout]:
    """Every parameter kind of a Llama-style layer (separate and fused q/k/v, gate/up) at TP=``tp``, cut by
    AutoTP's rule: attention on whole KV-head groups, MLP and vocabulary near-evenly."""
    kv, hidden = g["kv_heads"], g["hidden"]
    q, k = kv * g["group"] * g["head_dim"], kv * g["head_dim"]

    def sizes(total: int, name: str) -> tuple[int, ...]:
        return shard_sizes(total, tp, name=name, num_kv_heads=kv)

    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    return {
        f"{attn}.q_proj.weight": TPLayout.split((q, hidden), tp, 0, sizes(q, f"{attn}.q_proj"), "column"),
        f"{attn}.k_proj.weight": TPLayout.split((k, hidden), tp, 0, sizes(k, f"{attn}.k_proj"), "column"),
        f"{attn}.v_proj.weight": TPLayout.split((k, hidden), tp, 0, sizes(k, f"{attn}.v_proj"), "column"),
        f"{attn}.o_proj.weight": TPLayout.split((hidden, q), tp, 1, sizes(q, f"{attn}.o_proj"), "row"),
        f"{attn}.qkv_proj.weight": TPLayout.sub_params((q + 2 * k, hidden), tp, 0, (q, k, k),
                                                       (sizes(q, f"{attn}.qkv_proj"), sizes(k, f"{attn}.qkv_proj"),
                                                        sizes(k, f"{attn}.qkv_proj")), role="fused_qkv"),
        f"{mlp}.gate_proj.weight": TPLayout.split((g["mlp"], hidden), tp, 0, sizes(g["mlp"], f"{mlp}.gate_proj"),
                                                  "column"),
        f"{mlp}.down_proj.weight": TPLayout.split((hidden, g["mlp"]), tp, 1, sizes(g["mlp"], f"{mlp}.down_proj"),
                                                  "row"),
        f"{mlp}.gate_up_proj.weight": TPLayout.sub_params((2 * g["mlp"], hidden), tp, 0, (g["mlp"], g["mlp"]),
                                                          (sizes(g["mlp"], f"{mlp}.gate_up_proj"), ) * 2,
                                                          role="gate_up"),
        "lm_head.weight": TPLayout.split((g["vocab"], hidden), tp, 0, sizes(g["vocab"], "lm_head"), "column",
                                         role="vocab"),
        "model.embed_tokens.weight": TPLayout.split((g["vocab"], hidden), tp, 0, shard_sizes(g["vocab"], tp),
                                                    "column", role="vocab"),
        "model.norm.weight": TPLayout.replicated((hidden, ), tp),
    }


@settings(max_examples=300, deadline=None)
@given(model_geometries(), st.integers(1, 8), st.integers(1, 8))
def test_model_geometry_reshards_exactly_empty_shards_included(geometry, tp_from, tp_to):
    """Saved at TP=tp_from, loaded at TP=tp_to: for every parameter, reshard equals slicing the full tensor and
    reads each saved element once. The attention cut keeps whole GQA groups (a rank's query heads are those of
    its KV heads), and the ranks beyond the KV-head count hold empty shards."""
    saved, wanted = model_layouts(geometry, tp_from), model_layouts(geometry, tp_to)
    kv, group = geometry["kv_heads"], geometry["group"]
    for tp, layouts in ((tp_from, saved), (tp_to, wanted)):
        attn = "model.layers.0.self_attn"
        for rank in range(tp):
            q = layouts[f"{attn}.q_proj.weight"].local_width(rank)
            k = layouts[f"{attn}.k_proj.weight"].local_width(rank)
            assert q == group * k and layouts[f"{attn}.o_proj.weight"].local_width(rank) == q
            assert layouts[f"{attn}.qkv_proj.weight"].local_width(rank) == q + 2 * k
            assert (k == 0) == (rank >= kv)  # empty exactly beyond the head count
    for name, source in saved.items():
        target = wanted[name]
        full = torch.arange(source.numel, dtype=torch.int64).reshape(source.shape)
        read: list[int] = []
        read_flat = _recording_reader(source, full, read)
        for rank in range(tp_to):
            got = source.reshard(target, rank, read_flat)
            assert tuple(got.shape) == target.local_shape(rank), (name, rank)
            assert torch.equal(got, target.slice(full, rank)), (name, rank)
        if _split_on_rows(source, target):
            assert sum(read) == source.numel * (tp_to if source.is_replicated else 1), name
