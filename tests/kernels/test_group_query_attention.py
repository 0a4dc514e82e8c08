"""The library's GroupQueryAttention (a decoder prompt's attention in bf16: AMX tiles, or AVX-512 BF16; a decode step's
in float: AVX-512, or AVX2) through onnxruntime, as onnxruntime-genai runs it (past and present sharing one cache
buffer): a first prompt and a follow-up prompt against a float64 numpy reference (rotary embedding, causal, several
query heads per K/V head) within the bound bf16 operands allow, and the cache it writes against the same reference; a
decode step or a few tokens in float, on each float path this CPU has, against the same reference within float32
rounding; every other form (a cache not shared, the routing's mode record without rotary, a prompt where the CPU lacks
bf16) answers exactly as onnxruntime's own kernel, which the library runs for them."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from builder_plugin import kernels

ATTENTION = kernels.attention()  # "bf16 AMX", "bf16 AVX-512" or "" (onnxruntime's kernel)
REGISTERED = ATTENTION != ""
STEP = kernels.step_attention()  # "float AVX-512", "float AVX2" or "" (the library registers nothing here)
# BUILDER_PLUGIN_OPS_PATH values for each float path of a step this CPU has ("": its own choice)
STEP_PATHS = {"": STEP, "avx2": "float AVX2" if STEP else ""}
# BUILDER_PLUGIN_OPS_PATH values that hold the library to int8 paths on this CPU (forcing a path it lacks leaves the
# default)
FORCED_INT8 = ["avx512", "panels"] + (["amx"] if kernels.level() in ("amx", "amx_bf16") else [])
POSITIONS = 512


def write_graph(path, heads: int, kv_heads: int, head_dim: int, rotary: bool = True, packed: bool = True,
                rotary_dim: int | None = None) -> str:
    import onnx
    from onnx import TensorProto, helper

    width = (heads + 2 * kv_heads) * head_dim if packed else heads * head_dim
    inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT, [1, None, width])]
    names = ["query", "", ""]
    if not packed:
        names[1:3] = ["key", "value"]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, None, kv_heads * head_dim])
                   for n in ("key", "value")]
    names += ["past_key", "past_value", "seqlens_k", "total_length"]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, kv_heads, None, head_dim])
               for n in ("past_key", "past_value")]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
               helper.make_tensor_value_info("total_length", TensorProto.INT32, [])]
    if rotary:
        names += ["cos", "sin"]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [POSITIONS, (rotary_dim or head_dim) // 2])
                   for n in ("cos", "sin")]
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_key", "present_value"], name="gqa",
                            domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads,
                            scale=float(head_dim) ** -0.5, local_window_size=-1, softcap=0.0,
                            do_rotary=int(rotary), rotary_interleaved=0)
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, None, heads * head_dim])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, kv_heads, None, head_dim])
                for n in ("present_key", "present_value")]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
    return str(path)


def session(path: str, library: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if library:
        options.register_custom_ops_library(str(kernels.library_path()))
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def rope(rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(POSITIONS)[:, None] * 10000.0 ** (-np.arange(rotary_dim // 2) / (rotary_dim // 2))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class SharedCache:
    """A cache of `buffer` positions that past_key/value and present_key/value share, as onnxruntime-genai binds it."""

    def __init__(self, kv_heads: int, buffer: int, head_dim: int):
        self.arrays = [np.zeros((1, kv_heads, buffer, head_dim), np.float32) for _ in range(2)]
        self.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays]
        self.total = 0

    def step(self, sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> np.ndarray:
        self.total += feeds["query"].shape[1]
        binding = sess.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_cpu_input("seqlens_k", np.array([self.total - 1], np.int32))
        binding.bind_cpu_input("total_length", np.array(self.total, np.int32))
        binding.bind_output("out")
        for past, present, value in zip(("past_key", "past_value"), ("present_key", "present_value"), self.values):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        sess.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    def keys(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(v.numpy()[0, :, :self.total].astype(np.float64) for v in self.values)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [..., tokens, head_dim] turned at the tokens' positions (cos, sin: [tokens, rotary_dim / 2]), not
    interleaved, over its first rotary_dim dims; the rest as they are."""
    half = cos.shape[-1]
    first, second, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin, rest], axis=-1)


def reference(queries: list[np.ndarray], heads: int, kv_heads: int, head_dim: int, rotary_dim: int):
    """Per prompt of `queries` (packed [1, S, (heads + 2 kv_heads) x head_dim], one after the other in one cache):
    (the attention output in float64, the bound of the bf16 kernel's error, as test_attention's reference), and the
    cache after all of them (rotated K, V)."""
    cos, sin = (c.astype(np.float64) for c in rope(rotary_dim))
    keys = np.zeros((kv_heads, 0, head_dim))
    values = np.zeros((kv_heads, 0, head_dim))
    results = []
    for query in queries:
        tokens = query.shape[1]
        past = keys.shape[1]
        x = query[0].astype(np.float64).reshape(tokens, heads + 2 * kv_heads, head_dim).transpose(1, 0, 2)
        at = slice(past, past + tokens)
        q = rotate(x[:heads], cos[at], sin[at])
        keys = np.concatenate([keys, rotate(x[heads:heads + kv_heads], cos[at], sin[at])], axis=1)
        values = np.concatenate([values, x[heads + kv_heads:]], axis=1)
        k = np.repeat(keys, heads // kv_heads, axis=0)
        v = np.repeat(values, heads // kv_heads, axis=0)
        scale = head_dim ** -0.5
        scores = q @ k.transpose(0, 2, 1) * scale
        visible = np.arange(past + tokens)[None, :] <= past + np.arange(tokens)[:, None]
        scores = np.where(visible, scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        score_error = (np.abs(q) @ np.abs(k).transpose(0, 2, 1)) * scale * (2 * 2.0 ** -8 + 2.0 ** -16
                                                                           + head_dim * 2.0 ** -23)
        score_error = np.where(visible, score_error, 0)
        relative = (np.exp(2 * score_error.max(axis=-1, keepdims=True)) - 1) * (1 + 2.0 ** -8) + 2 * 2.0 ** -8 + \
            2.0 ** -16 + (past + tokens) * 2.0 ** -23
        out = (p @ v).transpose(1, 0, 2).reshape(tokens, heads * head_dim)
        bound = ((p @ np.abs(v)) * relative).transpose(1, 0, 2).reshape(tokens, heads * head_dim)
        results.append((out, bound))
    return results, (keys, values)


# (heads, kv_heads, head_dim, rotary_dim, prompt lengths): Phi-4-mini's heads (rotary over 96 of 128 dims); one K/V
# head per query head; a follow-up prompt over a past not a multiple of 16 or 32; prompts not multiples of 16 or 32
CASES = [
    (24, 8, 128, 96, [40, 33]),
    (4, 4, 64, 64, [16, 100]),
    (6, 2, 96, 96, [77, 18]),
    (6, 3, 64, 16, [20, 50]),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rotary_dim", "lengths"), CASES)
def test_prompts_within_the_bf16_bound(tmp_path, heads, kv_heads, head_dim, rotary_dim, lengths):
    rng = np.random.default_rng(sum(lengths) + head_dim)
    sess = session(write_graph(tmp_path / "g.onnx", heads, kv_heads, head_dim, rotary_dim=rotary_dim), library=True)
    cos, sin = rope(rotary_dim)
    cache = SharedCache(kv_heads, 256, head_dim)
    queries = [rng.standard_normal((1, n, (heads + 2 * kv_heads) * head_dim)).astype(np.float32) for n in lengths]
    got = [cache.step(sess, {"query": q, "cos": cos, "sin": sin})[0].astype(np.float64) for q in queries]
    expected, (keys, values) = reference(queries, heads, kv_heads, head_dim, rotary_dim)
    for out, (want, bound) in zip(got, expected):
        assert np.all(np.abs(out - want) <= bound)
    cached_keys, cached_values = cache.keys()
    np.testing.assert_allclose(cached_keys, keys, rtol=1e-5, atol=1e-5)  # rotated in float32
    np.testing.assert_array_equal(cached_values, values)


# (heads, kv_heads, head_dim, rotary_dim): Phi-4-mini's; three query heads per K/V head; one per K/V head; five (more
# than the AVX2 path's bundle of four) over an odd number of 16 dims (onnxruntime takes head dims that are multiples
# of 16)
DECODE_SHAPES = [(24, 8, 128, 96), (6, 2, 64, 64), (4, 4, 96, 64), (10, 2, 80, 64)]


@pytest.mark.parametrize("forced", STEP_PATHS)
@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("lengths", [[3, 1, 5, 1, 15], [20, 1, 1, 5, 30, 1]])
def test_decode_steps_and_short_prompts_in_float(tmp_path, monkeypatch, lengths, shape, forced):
    """Fewer than 16 new tokens (a decode step, a few speculative ones) run the library's float path where it registers
    (else onnxruntime's kernel, the same bits): against the float64 reference within float32 rounding, and as close
    to onnxruntime's own kernel; the keys it rotates into the cache as the reference's."""
    if forced:
        monkeypatch.setenv("BUILDER_PLUGIN_OPS_PATH", forced)
    assert kernels.step_attention() == STEP_PATHS[forced]
    heads, kv_heads, head_dim, rotary_dim = shape
    path = write_graph(tmp_path / "g.onnx", heads, kv_heads, head_dim, rotary_dim=rotary_dim)
    cos, sin = rope(rotary_dim)
    rng = np.random.default_rng(len(lengths))
    queries = [rng.standard_normal((1, n, (heads + 2 * kv_heads) * head_dim)).astype(np.float32) for n in lengths]
    answers, caches = {}, {}
    for library in (True, False):
        cache = SharedCache(kv_heads, 128, head_dim)
        sess = session(path, library)
        answers[library] = [cache.step(sess, {"query": q, "cos": cos, "sin": sin}) for q in queries]
        caches[library] = cache.keys()
    expected, (keys, values) = reference(queries, heads, kv_heads, head_dim, rotary_dim)
    for n, mine, theirs, (want, _) in zip(lengths, answers[True], answers[False], expected):
        if n >= 16:
            continue  # the bf16 paths: test_prompts_within_the_bf16_bound
        if not STEP:
            np.testing.assert_array_equal(mine, theirs)
            continue
        np.testing.assert_allclose(mine[0], want, rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(caches[True][0], keys, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(caches[True][1], values)


def test_a_cache_not_shared_answers_as_onnxruntime(tmp_path):
    """past and present apart (genai_config past_present_share_buffer false): onnxruntime's kernel, the same bits."""
    heads, kv_heads, head_dim = 4, 2, 64
    path = write_graph(tmp_path / "g.onnx", heads, kv_heads, head_dim)
    cos, sin = rope(head_dim)
    rng = np.random.default_rng(5)
    feeds = {"query": rng.standard_normal((1, 40, (heads + 2 * kv_heads) * head_dim)).astype(np.float32),
             "past_key": rng.standard_normal((1, kv_heads, 10, head_dim)).astype(np.float32),
             "past_value": rng.standard_normal((1, kv_heads, 10, head_dim)).astype(np.float32),
             "seqlens_k": np.array([49], np.int32), "total_length": np.array(50, np.int32), "cos": cos, "sin": sin}
    for mine, theirs in zip(session(path, True).run(None, feeds), session(path, False).run(None, feeds)):
        np.testing.assert_array_equal(mine, theirs)


def test_the_mode_record_without_rotary_answers_as_onnxruntime(tmp_path):
    """The routing's mode record: separate query, key and value, no rotary: onnxruntime's kernel, the same bits."""
    heads, head_dim = 8, 16
    path = write_graph(tmp_path / "g.onnx", heads, heads, head_dim, rotary=False, packed=False)
    rng = np.random.default_rng(6)
    feeds = {n: rng.standard_normal((1, 24, heads * head_dim)).astype(np.float32) for n in ("query", "key", "value")}
    answers = []
    for library in (True, False):
        cache = SharedCache(heads, 64, head_dim)
        answers.append((cache.step(session(path, library), feeds), cache.keys()))
    np.testing.assert_array_equal(answers[0][0], answers[1][0])
    for mine, theirs in zip(answers[0][1], answers[1][1]):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("forced", STEP_PATHS)
def test_the_trace_names_the_paths(tmp_path, capfd, monkeypatch, forced):
    """Each kernel made says which paths it may take, and its first prompt which one it took (a form the tiles could
    run silently left to onnxruntime would show here)."""
    monkeypatch.setenv("BUILDER_PLUGIN_OPS_TRACE", "1")
    if forced:
        monkeypatch.setenv("BUILDER_PLUGIN_OPS_PATH", forced)
    prompts = kernels.attention()
    tiles = session(write_graph(tmp_path / "g.onnx", 4, 2, 64, rotary_dim=48), library=True)
    session(write_graph(tmp_path / "h.onnx", 4, 4, 64, rotary=False, packed=False), library=True)
    cos, sin = rope(48)
    query = np.random.default_rng(8).standard_normal((1, 20, 8 * 64)).astype(np.float32)
    SharedCache(2, 64, 64).step(tiles, {"query": query, "cos": cos, "sin": sin})
    err = capfd.readouterr().err
    if not STEP:
        assert "GroupQueryAttention" not in err
        return
    where = f"the {prompts} path" if prompts else "onnxruntime's kernel"
    assert (f"GroupQueryAttention gqa num_heads=4 kv_num_heads=2: {where} for prompts, the {STEP_PATHS[forced]} "
            "path for fewer than 16 tokens") in err
    assert "GroupQueryAttention gqa num_heads=4 kv_num_heads=4: onnxruntime's kernel" in err
    if prompts:
        assert f"GroupQueryAttention gqa: a prompt of 20 new tokens on the {prompts} path" in err
    else:  # onnxruntime's kernel is the only one prompts have here: nothing to tell
        assert "a prompt of" not in err


@pytest.mark.parametrize("forced", FORCED_INT8)
def test_a_forced_int8_path_leaves_attention_to_onnxruntime(tmp_path, monkeypatch, forced):
    """BUILDER_PLUGIN_OPS_PATH=avx512|panels|amx stands for a CPU without bf16: a prompt runs onnxruntime's own kernel,
    the same bits."""
    heads, kv_heads, head_dim = 4, 2, 64
    path = write_graph(tmp_path / "g.onnx", heads, kv_heads, head_dim)
    cos, sin = rope(head_dim)
    query = np.random.default_rng(7).standard_normal((1, 40, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    monkeypatch.setenv("BUILDER_PLUGIN_OPS_PATH", forced)
    answers = [SharedCache(kv_heads, 64, head_dim).step(session(path, library), {"query": query, "cos": cos,
                                                                                    "sin": sin})
               for library in (True, False)]
    np.testing.assert_array_equal(*answers)
