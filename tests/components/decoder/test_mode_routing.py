"""The self-routing decoder's two passes on small graphs made here, run in onnxruntime against numpy: the mode state
(`add_mode_state`) over a conversation of several calls, and the LoRA branches moved into Ifs (`route_lora_branches`)
for one projection and for a packed one whose A MatMul feeds two."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from builder_plugin.components.decoder.kv import KVLayer
from builder_plugin.components.decoder.lora_names import lora_node, parse_lora_node
from builder_plugin.components.decoder.mode_routing import ROUTED_ADAPTERS, add_mode_state, route_lora_branches
from builder_plugin.graph import MS_DOMAIN
from builder_plugin.layout import INPUT_IDS, INPUTS_EMBEDS

FLOAT, BOOL = ir.TensorType(ir.DataType.FLOAT), ir.TensorType(ir.DataType.BOOL)
HEAD = 8  # one KV head of this size; the embeddings are as wide
IMAGE, AUDIO = 7, 9  # the placeholder ids given to add_mode_state


def session(model: ir.Model) -> ort.InferenceSession:
    proto = ir.serde.serialize_model(model)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def one_layer_decoder() -> tuple[ir.Model, ir.Value, ir.Value]:
    """A decoder of one GroupQueryAttention layer with the inputs and outputs onnxruntime-genai's decoders have, and
    the mode state added; the mode booleans are graph outputs too."""
    embeds = ir.val(INPUTS_EMBEDS, shape=["batch", "sequence", HEAD], type=FLOAT)
    past = [ir.val(name, shape=["batch", 1, "past", HEAD], type=FLOAT)
            for name in (KVLayer(0).past_key, KVLayer(0).past_value)]
    seqlens_k = ir.val("seqlens_k", shape=["batch"], type=ir.TensorType(ir.DataType.INT32))
    total = ir.val("total_sequence_length", shape=[], type=ir.TensorType(ir.DataType.INT32))
    gqa = ir.node("GroupQueryAttention", [embeds, embeds, embeds, *past, seqlens_k, total],
                  attributes={"num_heads": 1, "kv_num_heads": 1}, domain=MS_DOMAIN, name="/model/layers.0/attn/GQA",
                  num_outputs=3)
    for value, name in zip(gqa.outputs, ("hidden", KVLayer(0).present_key, KVLayer(0).present_value)):
        value.name = name
        value.type = FLOAT
    graph = ir.Graph([embeds, *past, seqlens_k, total], list(gqa.outputs), nodes=[gqa],
                     opset_imports={"": 21, MS_DOMAIN: 1})
    model = ir.Model(graph, ir_version=10)
    is_vision, is_speech = add_mode_state(model, num_layers=1, kv_heads=1, head_size=HEAD,
                                          placeholder_ids=(IMAGE, AUDIO))
    model.graph.outputs.extend([is_vision, is_speech])
    return model, is_vision, is_speech


class Conversation:
    """Calls of one conversation: each call's presents are the next call's pasts (without a shared buffer)."""

    def __init__(self, run: ort.InferenceSession) -> None:
        self.run = run
        self.past = {name: np.zeros((1, 1, 0, HEAD), np.float32)
                     for layer in (0, 1) for name in (KVLayer(layer).past_key, KVLayer(layer).past_value)}

    def call(self, ids: list[int]) -> str:
        length = next(iter(self.past.values())).shape[2] + len(ids)
        feeds = {INPUTS_EMBEDS: np.random.default_rng(length).standard_normal((1, len(ids), HEAD), np.float32),
                 INPUT_IDS: np.array([ids], np.int64), "seqlens_k": np.array([length - 1], np.int32),
                 "total_sequence_length": np.array(length, np.int32), **self.past}
        names = [o.name for o in self.run.get_outputs()]
        out = dict(zip(names, self.run.run(None, feeds)))
        for layer in (0, 1):
            self.past[KVLayer(layer).past_key] = out[KVLayer(layer).present_key]
            self.past[KVLayer(layer).past_value] = out[KVLayer(layer).present_value]
        vision, speech = bool(out["/model/mode/is_vision"]), bool(out["/model/mode/is_speech"])
        assert not (vision and speech)
        return "vision" if vision else "speech" if speech else "text"


def test_the_mode_is_the_conversations_and_kept_across_calls() -> None:
    model, _, _ = one_layer_decoder()
    names = [v.name for v in model.graph.inputs]
    assert names[-3:] == [INPUT_IDS, KVLayer(1).past_key, KVLayer(1).past_value]
    assert [v.name for v in model.graph.outputs][3:5] == [KVLayer(1).present_key, KVLayer(1).present_value]
    run = session(model)
    # the original model's rule, for the whole conversation: any image -> vision, else any audio -> speech
    audio_first = Conversation(run)
    assert [audio_first.call(ids) for ids in ([5, AUDIO, AUDIO, 6], [11], [12, 13], [IMAGE, 14], [15])] == [
        "speech", "speech", "speech", "vision", "vision"]
    text = Conversation(run)
    assert [text.call(ids) for ids in ([1, 2, 3], [4], [5, 6])] == ["text", "text", "text"]
    both = Conversation(run)
    assert [both.call(ids) for ids in ([AUDIO, IMAGE, 3], [4])] == ["vision", "vision"]
    late_audio = Conversation(run)
    assert [late_audio.call(ids) for ids in ([1, 2], [3], [AUDIO], [4])] == ["text", "text", "speech", "speech"]


K, N, R = 6, 5, 2


def lora_graph(packed: bool) -> tuple[ir.Model, dict[str, np.ndarray]]:
    """x -> projection(s) with a vision and a speech LoRA branch each, named as the GenAI builder subclass names them,
    -> Relu (a packed projection: gate and up, one A per adapter for both, multiplied). The mode booleans are graph
    inputs here."""
    rng = np.random.default_rng(0)
    x = ir.val("x", shape=[1, 3, K], type=FLOAT)
    conditions = [ir.val(name, shape=[], type=BOOL) for name in ("is_vision", "is_speech")]
    weights: dict[str, np.ndarray] = {}
    initializers: list[ir.Value] = []
    nodes: list[ir.Node] = []

    def weight(name: str, shape: tuple[int, int]) -> ir.Value:
        weights[name] = rng.standard_normal(shape).astype(np.float32)
        value = ir.Value(name=name, shape=ir.Shape(shape), type=FLOAT, const_value=ir.tensor(weights[name], name=name))
        initializers.append(value)
        return value

    def op(kind: str, inputs: list[ir.Value], name: str) -> ir.Value:
        node = ir.node(kind, inputs, name=name)
        node.outputs[0].name = f"{name}/output_0"
        nodes.append(node)
        return node.outputs[0]

    owner = "/model/layers.0/mlp/gate_up_proj" if packed else "/model/layers.0/mlp/down_proj"
    sites = ["/model/layers.0/mlp/gate_proj", "/model/layers.0/mlp/up_proj"] if packed else [owner]
    a = {adapter: op("MatMul", [x, weight(f"A_{adapter}", (K, R))], lora_node(owner, adapter, "A"))
         for adapter in ROUTED_ADAPTERS}
    outputs = []
    for site in sites:
        y = op("MatMul", [x, weight(f"W{site}", (K, N))], f"{site}/MatMul")
        for adapter in ROUTED_ADAPTERS:  # chained, as the builder adds them: base + vision, then + speech
            b = op("MatMul", [a[adapter], weight(f"B_{adapter}{site}", (R, N))], lora_node(site, adapter, "B"))
            y = op("Add", [y, b], lora_node(site, adapter, "Add"))
        outputs.append(y)
    joined = op("Mul", outputs, "/model/layers.0/mlp/Mul") if packed else outputs[0]
    out = op("Relu", [joined], "/model/out/Relu")
    graph = ir.Graph([x, *conditions], [out], nodes=nodes, initializers=initializers, opset_imports={"": 21})
    return ir.Model(graph, ir_version=10), weights


def expected(x: np.ndarray, weights: dict[str, np.ndarray], packed: bool, mode: str) -> np.ndarray:
    sites = [f"/model/layers.0/mlp/{p}_proj" for p in (("gate", "up") if packed else ("down",))]
    ys = []
    for site in sites:
        y = x @ weights[f"W{site}"]
        if mode != "text":
            y = y + (x @ weights[f"A_{mode}"]) @ weights[f"B_{mode}{site}"]
        ys.append(y)
    return np.maximum(ys[0] * ys[1] if packed else ys[0], 0)


@pytest.mark.parametrize("packed", [False, True], ids=["one-projection", "packed"])
def test_each_mode_runs_its_own_adapter_behind_an_if(packed: bool) -> None:
    model, weights = lora_graph(packed)
    graph = model.graph
    is_vision, is_speech = graph.inputs[1], graph.inputs[2]
    assert route_lora_branches(model, is_vision, is_speech) == len(ROUTED_ADAPTERS)
    assert [parse_lora_node(n.name) for n in graph] == [None] * len(graph)  # every branch moved
    ifs = [n for n in graph if n.op_type == "If"]
    owner = "/model/layers.0/mlp/gate_up_proj" if packed else "/model/layers.0/mlp/down_proj"
    assert [n.name for n in ifs] == [f"{owner}/lora.{adapter}/If" for adapter in ROUTED_ADAPTERS]
    assert [n.inputs[0] for n in ifs] == [is_vision, is_speech]
    for node in ifs:
        assert len(node.outputs) == (2 if packed else 1)
        assert not node.attributes["then_branch"].value.initializers  # the adapters stay main-graph initializers
        assert {n.op_type for n in node.attributes["else_branch"].value} == {"Identity"}
    assert ifs[1].attributes["else_branch"].value[0].inputs[0].producer() is ifs[0]  # chained, not nested
    run = session(model)
    x = np.random.default_rng(1).standard_normal((1, 3, K)).astype(np.float32)
    for mode, flags in {"text": (False, False), "vision": (True, False), "speech": (False, True)}.items():
        (got,) = run.run(None, {"x": x, "is_vision": np.array(flags[0]), "is_speech": np.array(flags[1])})
        np.testing.assert_allclose(got, expected(x, weights, packed, mode), rtol=1e-5, atol=1e-5, err_msg=mode)


def test_an_adapter_that_is_not_routed_is_refused() -> None:
    model, _ = lora_graph(packed=False)
    a_node = next(n for n in model.graph if n.name == lora_node("/model/layers.0/mlp/down_proj", "speech", "A"))
    a_node.name = lora_node("/model/layers.0/mlp/down_proj", "music", "A")
    with pytest.raises(ValueError, match="'music'"):
        route_lora_branches(model, model.graph.inputs[1], model.graph.inputs[2])
