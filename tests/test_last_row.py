"""Prefill's last layer computes attention for the picked query row and its feed-forward block on
the picked row only (``toolkit.last_row``),
and the runner lays its weights out in the order a decode step reads them (``runner.load``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import TINY_QWEN2

from dctms.runner.load import weight_use_order
from dctms.toolkit.last_row import last_layer_on_picked_row

CHUNK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("last-row")
    write_tiny_model(folder, dict(TINY_QWEN2))
    return folder


def _shapes(phase, primitive: str) -> list[list[int]]:
    shapes = {t.id: t.shape for t in phase.tensors}
    return [shapes[op.outputs[0]] for op in phase.ops if op.primitive == primitive]


def test_the_last_layer_feed_forward_is_planned_for_one_row(tiny) -> None:
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan

    plan = compile_plan(open_model(tiny), CompileOptions(64, 8, prefill_chunk=CHUNK))
    phases = {p.name: p for p in plan.phases}
    hidden = TINY_QWEN2["intermediate_size"]
    # SwiGLU's Sigmoid, once per layer: layer 0 over the chunk, the last layer over one row
    assert _shapes(phases["prefill"], "Sigmoid") == [[1, CHUNK, hidden], [1, 1, hidden]]
    assert _shapes(phases["decode"], "Sigmoid") == [[1, 1, hidden], [1, 1, hidden]]
    # attention's softmax ([batch, kv heads, repeats, queries, window]): one query in the last
    window = phases["prefill"].lengths.bound[1]
    assert _shapes(phases["prefill"], "Softmax") == [[1, 2, 2, CHUNK, window], [1, 2, 2, 1, window]]


def _pick(last_index: mx.array):
    def pick(x: mx.array, axis: int) -> mx.array:
        size = list(x.shape)
        size[axis] = 1
        return mx.slice(x, last_index.reshape(1), axes=(axis,), slice_size=tuple(size))

    return pick


def test_the_picked_row_keeps_its_value_and_the_others_are_not_computed(tiny) -> None:
    from mlx_lm.utils import load_model

    from dctms.toolkit.trace import StaticKVCache

    model, _ = load_model(tiny)
    heads = TINY_QWEN2["num_key_value_heads"]
    head_dim = TINY_QWEN2["hidden_size"] // TINY_QWEN2["num_attention_heads"]

    def caches():  # the tracer's cache: its mask is an array, one row per query
        zeros = mx.zeros((1, heads, 17, head_dim))
        layers = TINY_QWEN2["num_hidden_layers"]
        return [StaticKVCache(zeros, zeros, mx.array(0), 16) for _ in range(layers)]

    tokens = mx.array([[(7 * i + 3) % 256 for i in range(12)]])
    full = model(tokens, cache=caches())
    index = 9  # a padded chunk's last real row
    real = mx.fast.scaled_dot_product_attention
    with last_layer_on_picked_row(model.model, _pick(mx.array(index))) as applied:
        picked = model(tokens, cache=caches())
        assert mx.fast.scaled_dot_product_attention is real  # patched only inside the layer
    assert applied
    assert mx.allclose(picked[0, index], full[0, index], atol=1e-4).item()
    # every other row got the picked row's attention and feed-forward: not the full model's value
    assert not mx.allclose(picked[0, 2], full[0, 2], atol=1e-2).item()
    assert mx.fast.scaled_dot_product_attention is real
    # and the model is restored afterwards
    assert isinstance(model.model.layers[-1].mlp, nn.Module)
    assert mx.array_equal(model(tokens, cache=caches()), full).item()


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(4, 4)


class _Inner(nn.Module):
    def __init__(self, stages: int):
        super().__init__()
        self.layers = [_Layer(), _Layer()]
        self.pipeline_size = stages


def test_not_applied_to_a_pipeline_stage_or_a_layer_without_feed_forward() -> None:
    pick = _pick(mx.array(0))
    staged = _Inner(stages=2)  # a stage's output rows all go to the next stage
    with last_layer_on_picked_row(staged, pick) as applied:
        assert not applied and isinstance(staged.layers[-1].mlp, nn.Module)
    bare = _Inner(stages=1)
    del bare.layers[-1].mlp
    with last_layer_on_picked_row(bare, pick) as applied:
        assert not applied
    whole = _Inner(stages=1)
    with last_layer_on_picked_row(whole, pick) as applied:
        assert applied and not isinstance(whole.layers[-1], nn.Module)
        assert not isinstance(whole.layers[-1].mlp, nn.Module)
        assert isinstance(whole.layers[0].mlp, nn.Module)  # only the last layer
    assert isinstance(whole.layers[-1], _Layer) and isinstance(whole.layers[-1].mlp, nn.Module)


def test_weights_are_laid_out_in_the_order_decode_reads_them() -> None:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    names[1:1] = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(12)]
    inputs = [SimpleNamespace(id=f"w{k}", name=n, kind="weight") for k, n in enumerate(names)]
    ops = [SimpleNamespace(inputs=[f"w{k}", "x"]) for k in range(len(names))]
    decode = SimpleNamespace(name="decode", inputs=inputs, ops=ops)
    no_fused = SimpleNamespace(weights=SimpleNamespace(fused=[]))
    plan = SimpleNamespace(phases=[decode], model=no_fused)
    # mx.load's dict order is a hash order; lexicographic would put layer 10 before layer 2
    shuffled = sorted(names, key=hash) + ["lm_head.weight"]  # one the decode phase never reads
    assert weight_use_order(plan, shuffled) == [*names, "lm_head.weight"]


def test_a_fused_weights_parts_are_laid_out_end_to_end_where_it_is_read() -> None:
    from dctms.schema.types import FusedWeight

    parts = ["l.0.q.weight", "l.0.k.weight", "l.0.v.weight"]
    inputs = [
        SimpleNamespace(id="e", name="embed.weight", kind="weight"),
        SimpleNamespace(id="f", name="l.0.{q,k,v}.weight", kind="weight"),
        SimpleNamespace(id="o", name="l.0.o.weight", kind="weight"),
    ]
    ops = [SimpleNamespace(inputs=[t]) for t in ("e", "f", "o")]
    decode = SimpleNamespace(name="decode", inputs=inputs, ops=ops)
    model = SimpleNamespace(weights=SimpleNamespace(fused=[FusedWeight(inputs[1].name, parts)]))
    plan = SimpleNamespace(phases=[decode], model=model)
    names = ["l.0.o.weight", "l.0.v.weight", "embed.weight", "l.0.k.weight", "l.0.q.weight"]
    assert weight_use_order(plan, names) == ["embed.weight", *parts, "l.0.o.weight"]
