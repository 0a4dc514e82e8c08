"""The library's MultiHeadAttention (the encoders' attention in bf16: AMX tiles, or AVX-512 BF16) through onnxruntime,
against a float64 numpy reference within the bound bf16 operands allow, on the forms the builder's encoders use
(SigLIP: a key padding mask; the conformer: that and a relative position bias); the forms it does not run are refused
in one line. Where the CPU lacks bf16 the library does not register it and onnxruntime's own kernel answers."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from builder_plugin import kernels

ATTENTION = kernels.attention()  # "bf16 AMX", "bf16 AVX-512" or "" (onnxruntime's kernel)
REGISTERED = ATTENTION != ""
# BUILDER_PLUGIN_OPS_PATH values that hold the library to int8 paths on this CPU (forcing a path it lacks leaves the
# default)
FORCED_INT8 = ["avx512", "panels"] + (["amx"] if kernels.level() in ("amx", "amx_bf16") else [])
MASK_VALUE = -10000.0  # onnxruntime's default mask_filter_value


def write_graph(path, batch: int, heads: int, head_dim: int, mask: bool, bias_shape: list[int] | None,
                past: bool = False, qkv_bias: bool = False) -> str:
    import onnx
    from onnx import TensorProto, helper

    width = heads * head_dim
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, None, width]) for name in "qkv"]
    names = ["q", "k", "v", "qkv_bias" if qkv_bias else "", "mask" if mask else ""]
    if qkv_bias:
        inputs.append(helper.make_tensor_value_info("qkv_bias", TensorProto.FLOAT, [3 * width]))
    if mask:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, [batch, None]))
    names.append("bias" if bias_shape else "")
    if bias_shape:
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, bias_shape))
    if past:
        names += ["past_key", "past_value"]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, heads, None, head_dim])
                   for n in ("past_key", "past_value")]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("MultiHeadAttention", names, ["out"], domain="com.microsoft", name="mha",
                            num_heads=heads, scale=float(head_dim) ** -0.5)
    graph = helper.make_graph([node], "mha", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, None, width])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
    return str(path)


def run(path: str, feeds: dict[str, np.ndarray], library: bool) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if library:
        options.register_custom_ops_library(str(kernels.library_path()))
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def heads_of(x: np.ndarray, heads: int) -> np.ndarray:
    batch, length, width = x.shape
    return x.reshape(batch, length, heads, width // heads).transpose(0, 2, 1, 3).astype(np.float64)


def reference(feeds: dict[str, np.ndarray], heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(softmax(scale q k^T + bias + mask) v in float64, the bound of the bf16 kernel's error): q, k, v and the
    probabilities each move by at most 2^-8 of themselves in bf16, so each score by 2^-7 of scale x sum |q| |k| (and
    float32 sums), the probabilities by e^(2 max score error) - 1 of themselves, and the output by that and 2^-7 of
    sum p |v|."""
    q, k, v = (heads_of(feeds[n], heads) for n in "qkv")
    head_dim = q.shape[-1]
    scale = head_dim ** -0.5
    scores = q @ k.transpose(0, 1, 3, 2) * scale
    if "bias" in feeds:
        scores = scores + feeds["bias"]
    if "mask" in feeds:
        scores = scores + (1 - feeds["mask"][:, None, None, :]) * MASK_VALUE
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    score_error = (np.abs(q) @ np.abs(k).transpose(0, 1, 3, 2)) * scale * (2 * 2.0 ** -8 + 2.0 ** -16
                                                                           + head_dim * 2.0 ** -23)
    keys = k.shape[2]
    relative = (np.exp(2 * score_error.max(axis=-1, keepdims=True)) - 1) * (1 + 2.0 ** -8) + 2 * 2.0 ** -8 + \
        2.0 ** -16 + keys * 2.0 ** -23
    shape = feeds["q"].shape
    return ((p @ v).transpose(0, 2, 1, 3).reshape(shape),
            ((p @ np.abs(v)) * relative).transpose(0, 2, 1, 3).reshape(shape))


# (batch, queries, keys, heads, head_dim, key mask, bias shape): SigLIP's form (two crops, a padding mask), the
# conformer's (a mask and a [1, heads, S, T] bias), a bias per batch row, head dims past 32 / past 128, keys and
# queries not multiples of 16 or 32
CASES = [
    (2, 37, 37, 3, 24, True, None),
    (1, 70, 50, 2, 72, True, "heads"),
    (2, 33, 33, 4, 64, False, "batch"),
    (1, 100, 300, 2, 160, True, "heads"),
    (2, 256, 256, 2, 72, True, None),
]


@pytest.mark.parametrize(("batch", "queries", "keys", "heads", "head_dim", "mask", "bias"), CASES)
def test_attention_within_the_bf16_bound(tmp_path, batch, queries, keys, heads, head_dim, mask, bias):
    rng = np.random.default_rng(queries * keys + head_dim)
    bias_shape = {"heads": [1, heads, queries, keys], "batch": [batch, 1, queries, keys], None: None}[bias]
    path = write_graph(tmp_path / "g.onnx", batch, heads, head_dim, mask, bias_shape)
    feeds = {"q": rng.standard_normal((batch, queries, heads * head_dim)).astype(np.float32) * 2,
             "k": rng.standard_normal((batch, keys, heads * head_dim)).astype(np.float32),
             "v": rng.standard_normal((batch, keys, heads * head_dim)).astype(np.float32)}
    if mask:
        feeds["mask"] = (rng.random((batch, keys)) > 0.2).astype(np.int32)
        feeds["mask"][0, :] = 0 if batch > 1 else feeds["mask"][0, :]  # a fully padded row (SigLIP's padded crop)
    if bias_shape:
        feeds["bias"] = rng.standard_normal(bias_shape).astype(np.float32)
    expected, bound = reference(feeds, heads)
    got = run(path, feeds, library=True).astype(np.float64)
    if REGISTERED:
        assert np.all(np.abs(got - expected) <= bound)
    else:
        np.testing.assert_array_equal(got, run(path, feeds, library=False))


def test_forms_the_kernel_does_not_run_are_refused(tmp_path, capfd, monkeypatch):
    path = write_graph(tmp_path / "g.onnx", 1, 2, 16, False, None, past=True)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, 5, 32)).astype(np.float32) for n in "qkv"}
    feeds.update(past_key=np.zeros((1, 2, 3, 16), np.float32), past_value=np.zeros((1, 2, 3, 16), np.float32))
    monkeypatch.setenv("BUILDER_PLUGIN_OPS_TRACE", "1")
    if not REGISTERED:  # onnxruntime's own kernel takes the node (its answer for this form with a past can vary with
        # what earlier sessions left in the memory it reuses, so it is not compared here)
        capfd.readouterr()
        assert run(path, feeds, library=True).shape == (1, 5, 32)
        assert "MultiHeadAttention" not in capfd.readouterr().err
        return
    with pytest.raises(Exception, match="MultiHeadAttention mha: input 6 is not supported by the builder_plugin "
                                        "library's kernel"):
        run(path, feeds, library=True)
    assert f"MultiHeadAttention mha num_heads=2: {ATTENTION} path" in capfd.readouterr().err


@pytest.mark.parametrize("forced", FORCED_INT8)
def test_a_forced_int8_path_leaves_attention_to_onnxruntime(tmp_path, monkeypatch, forced):
    """BUILDER_PLUGIN_OPS_PATH=avx512|panels|amx stands for a CPU without bf16: the library registers no
    attention, so even a form it would refuse (a bias input) runs, and answers exactly as onnxruntime's own."""
    path = write_graph(tmp_path / "g.onnx", 1, 2, 16, False, None, qkv_bias=True)
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((1, 5, 32)).astype(np.float32) for n in "qkv"}
    feeds["qkv_bias"] = rng.standard_normal(96).astype(np.float32)
    monkeypatch.setenv("BUILDER_PLUGIN_OPS_PATH", forced)
    np.testing.assert_array_equal(run(path, feeds, library=True), run(path, feeds, library=False))
