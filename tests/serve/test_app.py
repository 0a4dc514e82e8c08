"""builder_plugin.serve.app: the chat-completions server on the tiny package, called with the official openai client.
Every answer is compared with a Chat run independently on the same package (greedy search)."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import httpx
import openai
import pytest

from builder_plugin.runtime import ChatError, Sampling
from builder_plugin.serve.__main__ import make_parser
from builder_plugin.serve.app import MB
from builder_plugin.testing.media import make_wav
from tests.support.serving import (
    AUDIO,
    IMAGE,
    SHORT,
    TOOLS,
    Answer,
    ask_chat,
    ask_server,
    b64,
    image_part,
    last_stats,
    running_server,
    user,
    wait_for,
)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("images", "audios"), [((), ()), ((IMAGE,), ()), ((), (AUDIO,)), ((IMAGE,), (AUDIO,))],
                         ids=["text", "image", "audio", "image+audio"])
def test_answer_equals_chat(server, chat, media_dir, stream, images, audios):
    images = tuple(media_dir / name for name in images)
    audios = tuple(media_dir / name for name in audios)
    messages = [{"role": "system", "content": "You are a tester."}, user("Describe what you get.", images, audios)]
    got = ask_server(server.client(), messages, stream=stream)
    expected, = ask_chat(chat, [("Describe what you get.", images, audios)], system="You are a tester.")
    assert got == expected
    assert got.finish_reason == "length" and got.completion_tokens == SHORT


def test_multi_turn_conversation_reuses_the_held_one(server, served, chat, media_dir):
    """Each request re-sends the conversation; the server restores it and asks the last question. After the first
    request, the restored history is exactly what the server's Chat holds (same answers, same media paths)."""
    questions = [("What is in this picture?", (media_dir / IMAGE,), ()), ("Tell me more.", (), ()),
                 ("And now?", (), ())]
    expected = ask_chat(chat, questions)
    client = server.client()
    messages: list[dict] = []
    served.restores_unchanged.clear()
    for (text, images, audios), want in zip(questions, expected):
        messages.append(user(text, images, audios))
        got = ask_server(client, messages, stream=len(messages) == 3)
        assert got == want
        messages.append({"role": "assistant", "content": got.text})
    assert served.restores_unchanged[1:] == [True, True]


def test_answers_sent_back_as_the_client_got_them(server, chat):
    """The openai client's own message objects go back as they came (their null refusal, audio, annotations), and a
    tool message may name its function."""
    client = server.client()
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=[user("Hi")], max_tokens=SHORT).choices[0].message
    for sent_back in (first, first.model_dump()):
        got = ask_server(client, [user("Hi"), sent_back, user("Tell me more.")])
        assert got == ask_chat(chat, [("Hi", (), ()), ("Tell me more.", (), ())])[1]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [user("Weather in Oslo?"), {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None,
                                           "audio": None, "function_call": None, "annotations": []},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}]
    without_name = [*messages[:2], {key: value for key, value in messages[2].items() if key != "name"}]
    assert ask_server(client, messages, tools=TOOLS) == ask_server(client, without_name, tools=TOOLS)


def test_stop_strings(server, chat):
    full, = ask_chat(chat, [("Count to ten.", (), ())], max_new_tokens=16)
    middle = len(full.text) // 2
    stop = full.text[middle:middle + 3]
    cut = full.text[:full.text.find(stop)]
    client = server.client()
    for stream in (False, True):
        got = ask_server(client, [user("Count to ten.")], stream=stream, max_tokens=16, stop=[stop, "never seen"])
        assert (got.text, got.finish_reason) == (cut, "stop")
    got = ask_server(client, [user("Count to ten.")], max_tokens=16, stop="never seen")
    assert (got.text, got.finish_reason) == (full.text, full.finish_reason)


def test_token_limits_and_sampling(server, chat):
    client = server.client()
    got = ask_server(client, [user("Hello!")], max_tokens=None, max_completion_tokens=3)
    assert got == ask_chat(chat, [("Hello!", (), ())], max_new_tokens=3)[0]
    sampling = Sampling(temperature=0.8, top_p=0.9, top_k=20, seed=7)
    got = ask_server(client, [user("Hello!")], max_tokens=8, temperature=0.8, top_p=0.9, seed=7,
                     extra_body={"top_k": 20})
    assert got == ask_chat(chat, [("Hello!", (), ())], max_new_tokens=8, sampling=sampling)[0]


def test_default_answer_cap(served, chat, tmp_path):
    """A request without max_tokens gets the server's cap; one may ask for less, or more up to the maximum length."""
    served.gate.set()
    with running_server(served, tmp_path, max_tokens=4) as running:
        client = running.client()
        card = httpx.get(f"{running.url}/v1/models").json()["data"][0]
        assert (card["max_tokens"], card["max_length"]) == (4, chat.max_length)
        for asked in (None, 2, 9):
            got = ask_server(client, [user("Tell me about lighthouses.")], max_tokens=asked)
            assert got == ask_chat(chat, [("Tell me about lighthouses.", (), ())], max_new_tokens=asked or 4)[0]
            assert got.completion_tokens <= (asked or 4)


def test_models_and_health(server, package):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [package.name]
    card = client.models.retrieve(package.name)
    assert card.id == package.name and card.created == int((package / "genai_config.json").stat().st_mtime)
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == package.name and not health["busy"]


def test_local_files_only_when_allowed(served, chat, media_dir, tmp_path):
    url = (media_dir / IMAGE).as_uri()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What?"}]}]
    with running_server(served, tmp_path) as refusing:
        with pytest.raises(openai.BadRequestError) as refused:
            ask_server(refusing.client(), messages)
        assert refused.value.code == "local_files_not_allowed"
    with running_server(served, tmp_path, allow_local_files=True) as allowing:
        assert ask_server(allowing.client(), messages) == ask_chat(chat, [("What?", (media_dir / IMAGE,), ())])[0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_low_detail_fits_a_photo_to_one_crop(server, served, chat, tiny_checkpoint, tmp_path, stream):
    """detail "low": the image scaled down to one crop of the package's vision processor (the crop size of the
    checkpoint's config), answered as Chat answers that image; "high" and "auto" send it whole."""
    import onnxruntime_genai as og
    from PIL import Image
    from skimage import data as photographs

    from builder_plugin.runtime import open_image

    photo = tmp_path / "photo.png"
    Image.fromarray(photographs.astronaut()).resize((1000, 700)).save(photo)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    crop = config["embd_layer"]["image_embd_layer"]["crop_size"]
    assert served.package.crop_side == crop
    fitted = open_image(photo, fit=crop)
    assert Image.open(io.BytesIO(fitted.data)).size == (crop, round(700 * crop / 1000))

    def message(detail: str | None) -> list[dict]:
        part = image_part(photo)
        if detail is not None:
            part["image_url"]["detail"] = detail
        return [{"role": "user", "content": [part, {"type": "text", "text": "What is in this picture?"}]}]

    low = ask_server(server.client(), message("low"), stream=stream)
    assert low == ask_chat(chat, [("What is in this picture?", (fitted,), ())])[0]
    # as many prompt tokens as the processor gives a picture of that size resized on its own
    resized = tmp_path / "resized.png"
    Image.open(photo).resize(Image.open(io.BytesIO(fitted.data)).size, Image.Resampling.LANCZOS).save(resized)
    processor = served.package.load(served.package.main_decoder).model.create_multimodal_processor()
    ids = processor("<|user|><|image_1|>What is in this picture?<|end|><|assistant|>",
                    images=og.Images.open(str(resized)))["input_ids"].as_numpy()
    assert low.prompt_tokens == ids.shape[-1]
    whole = ask_chat(chat, [("What is in this picture?", (photo,), ())])[0]
    assert whole.prompt_tokens > 2 * low.prompt_tokens
    for detail in ("high", "auto", None):
        assert ask_server(server.client(), message(detail), stream=stream) == whole, detail
    # --image-detail low: what "auto" and no detail mean; "high" still sends the image whole
    assert make_parser().parse_args(["pkg", "--image-detail", "low"]).image_detail == "low"
    with running_server(served, tmp_path, image_detail="low") as lowering:
        for detail in ("auto", None):
            assert ask_server(lowering.client(), message(detail), stream=stream) == low, detail
        assert ask_server(lowering.client(), message("high"), stream=stream) == whole


def _bad_requests(media_dir: Path, tmp_path: Path) -> dict[str, tuple[dict, int, str | None, str]]:
    """name -> (request fields, status, error code, a piece of the message)."""
    png = (media_dir / IMAGE).read_bytes()
    gif = b"GIF89a" + bytes(64)  # a GIF's first bytes, then nothing of one
    low_rate = make_wav(tmp_path / "low.wav", 1.0, sample_rate=6000)
    image_msg = lambda data, mime="image/png": {"role": "user", "content": [  # noqa: E731
        {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}, {"type": "text", "text": "?"}]}
    audio_msg = lambda data, fmt="wav": {"role": "user", "content": [  # noqa: E731
        {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}, {"type": "text", "text": "?"}]}
    return {
        "unknown role": ({"messages": [{"role": "function", "content": "x"}]}, 400, None,
                         "unsupported role 'function'"),
        "tool first": ({"messages": [{"role": "tool", "tool_call_id": "c", "content": "x"}]}, 400, None,
                       "must follow an assistant message with tool_calls"),
        "part type": ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
                      400, "unsupported_content_type", "unsupported part type 'video_url'"),
        "image base64": ({"messages": [image_msg("not base64!")]}, 400, "invalid_base64", "not valid base64"),
        "audio base64": ({"messages": [audio_msg("%%%")]}, 400, "invalid_base64", "not valid base64"),
        "broken gif": ({"messages": [image_msg(b64(gif), "image/gif")]}, 400, "invalid_image_format",
                       "messages[0].content[0].image_url: not a readable image (truncated GIF)"),
        "wav as image": ({"messages": [image_msg(b64((media_dir / AUDIO).read_bytes()))]}, 400,
                         "invalid_image_format", "not a readable image (not a JPEG, PNG, WebP, GIF, BMP or TIFF file)"),
        "http image": ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400, "invalid_image_url",
            "must be data: URLs"),
        "png as audio": ({"messages": [audio_msg(b64(png))]}, 400, "invalid_audio_format",
                         "messages[0].content[0].input_audio: not a readable audio clip (not a WAV, FLAC, Ogg or MP3"),
        "6 kHz audio": ({"messages": [audio_msg(b64(low_rate.read_bytes()))]}, 400, "invalid_audio_format",
                        "unsupported sample rate 6000 Hz (use 8000 to 192000)"),
        "audio format": ({"messages": [audio_msg(b64(png), "aac")]}, 400, "invalid_audio_format",
                         "wav, mp3, flac, ogg"),
        "image detail": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": f"data:image/png;base64,{b64(png)}", "detail": "medium"}}]}]}, 400, None,
            "messages[0].content[0].image_url.detail: must be one of auto, low, high, not 'medium'"),
        "participant name": ({"messages": [{"role": "user", "content": "Hi", "name": "ann"}]}, 400,
                             "unsupported_parameter", "messages[0].name: participant names are not supported"),
        "message field": ({"messages": [{"role": "system", "content": "Be brief.", "weight": 2}, user("Hi")]}, 400,
                          "unsupported_parameter", "messages[0].weight: unknown field of a system message"),
        "echoed value": ({"messages": [user("Hi"), {"role": "assistant", "content": "Yo", "audio": {"id": "a1"}},
                                       user("Hi")]}, 400, "unsupported_parameter",
                         "messages[1].audio: an answer's audio cannot be sent back to this model"),
        "part field": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache": 1}]}]},
                       400, "unsupported_parameter", "messages[0].content[0].cache: unknown field of a text part"),
        "image_url field": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": f"data:image/png;base64,{b64(png)}", "size": 9}}]}]}, 400, "unsupported_parameter",
            "messages[0].content[0].image_url.size: unknown field of image_url"),
        "image tags": ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(png)}"}},
            {"type": "text", "text": "<|image_1|> and <|image_2|>?"}]}]}, 400, "invalid_media_tags",
            "2 image tags (<|image_1|> <|image_2|>) but 1 image is attached"),
        "context": ({"messages": [user("word " * 5000)]}, 400, "context_length_exceeded", "the prompt is"),
        "last not user": ({"messages": [user("Hi"), {"role": "assistant", "content": "Hello"}]}, 400, None,
                          "the last message must be a user or tool message"),
        "assistant first": ({"messages": [{"role": "assistant", "content": "Hello"}, user("Hi")]}, 400, None,
                            "must answer a user or tool message"),
        "temperature": ({"messages": [user("Hi")], "temperature": 3}, 400, None, "temperature"),
        "n": ({"messages": [user("Hi")], "n": 2}, 400, None, "only one choice"),
        "format type": ({"messages": [user("Hi")], "response_format": {"type": "xml"}}, 400, None,
                        "response_format.type: 'xml' is not supported"),
        "schema refused": ({"messages": [user("Hi")], "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objectx"}}}}, 400, "invalid_schema", "Invalid type: objectx"),
        "penalty": ({"messages": [user("Hi")], "frequency_penalty": 0.5}, 400, "unsupported_parameter",
                    "frequency_penalty: not supported"),
        "unknown field": ({"messages": [user("Hi")], "extra_body": {"best_of": 2}}, 400, "unsupported_parameter",
                          "best_of: unknown field"),
        "top_logprobs alone": ({"messages": [user("Hi")], "top_logprobs": 2}, 400, None, "needs logprobs: true"),
        "top_logprobs 21": ({"messages": [user("Hi")], "logprobs": True, "top_logprobs": 21}, 400, None,
                            "top_logprobs"),
        "tool_choice alone": ({"messages": [user("Hi")], "tool_choice": "required"}, 400, None, "needs tools"),
        "unknown tool": ({"messages": [user("Hi")], "tools": TOOLS, "tool_choice": {
            "type": "function", "function": {"name": "nope"}}}, 400, None, "no tool is named 'nope'"),
        "bad parameters": ({"messages": [user("Hi")], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "objectx"}}}], "tool_choice": "required"}, 400, "invalid_schema",
            "tools: "),
        "model": ({"messages": [user("Hi")], "model": "gpt-5"}, 404, "model_not_found", "'gpt-5' is not served"),
    }


BAD_REQUESTS = ["unknown role", "tool first", "part type", "image base64", "audio base64", "broken gif",
                "wav as image", "http image", "image detail", "png as audio", "6 kHz audio", "audio format",
                "participant name", "message field", "echoed value", "part field", "image_url field", "image tags",
                "context", "last not user", "assistant first", "temperature", "n", "model", "format type",
                "schema refused", "penalty", "unknown field", "top_logprobs alone", "top_logprobs 21",
                "tool_choice alone", "unknown tool", "bad parameters"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, chat, media_dir, tmp_path):
    cases = _bad_requests(media_dir, tmp_path)
    assert sorted(cases) == sorted(BAD_REQUESTS)
    client = server.client()
    for name, (fields, status, code, message) in cases.items():
        fields.setdefault("model", server.routes.model_id)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(**fields, max_tokens=SHORT)
        error = caught.value
        assert (error.status_code, error.code) == (status, code), name
        assert message in error.message and "\n" not in error.body["message"], name
    with pytest.raises(openai.BadRequestError, match="start the server with a larger --max-length") as caught:
        client.chat.completions.create(model=server.routes.model_id, messages=[user("word " * 5000)])
    assert "max_length" not in caught.value.message  # the Python API's name is not the server's option
    # Streaming requests fail the same way, before any chunk.
    with pytest.raises(openai.BadRequestError, match="the prompt is"):
        client.chat.completions.create(model=server.routes.model_id, messages=[user("word " * 5000)], stream=True)
    assert ask_server(client, [user("Hello!")]) == ask_chat(chat, [("Hello!", (), ())])[0]


def test_malformed_json_and_unknown_paths(server):
    for body in (b"{not json", b"[1, 2]", "\u00e9".encode("latin-1")):
        response = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = httpx.get(f"{server.url}/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_body_over_the_limit(served, chat, media_dir, tmp_path):
    with running_server(served, tmp_path, max_body_bytes=MB // 8) as small:
        big = "x" * (MB // 4)
        with pytest.raises(openai.APIStatusError) as caught:
            ask_server(small.client(), [user(big)])
        assert caught.value.status_code == 413 and "--max-body-mb" in caught.value.message
        # a chunked body (no content-length) is cut off as well
        chunks = (json.dumps({"messages": [user(big)]})[i:i + 4096].encode() for i in range(0, MB // 4 + 100, 4096))
        response = httpx.post(f"{small.url}/v1/chat/completions", content=chunks)
        assert response.status_code == 413
        assert ask_server(small.client(), [user("Hi")]) == ask_chat(chat, [("Hi", (), ())])[0]


def test_audio_on_a_package_without_speech(package, media_dir, tmp_path):
    folder = tmp_path / "no-speech"
    folder.mkdir()
    for path in package.iterdir():
        if path.name != "genai_config.json":
            (folder / path.name).symlink_to(path)
    config = json.loads((package / "genai_config.json").read_text())
    config["model"]["speech"] = {"config_filename": ""}
    (folder / "genai_config.json").write_text(json.dumps(config))
    with running_server(folder) as no_speech:
        with pytest.raises(openai.BadRequestError) as caught:
            ask_server(no_speech.client(), [user("Listen.", audios=(media_dir / AUDIO,))])
        assert caught.value.code == "audio_not_supported"


def test_failures_while_answering(served):
    served.failure = ChatError  # the answers fail after their first piece: a "model" failure
    try:
        with running_server(served) as running:
            client = running.client()
            with pytest.raises(openai.APIError, match="the model failed on purpose"):
                list(client.chat.completions.create(model=running.routes.model_id, messages=[user("Hi")],
                                                    stream=True, max_tokens=SHORT))
            served.failure = KeyError  # a bug: 500, and the next request is served
            with pytest.raises(openai.InternalServerError, match="internal error: KeyError"):
                ask_server(client, [user("Hi")])
            served.failure = ChatError
            with pytest.raises(openai.BadRequestError, match="the model failed on purpose"):
                ask_server(client, [user("Hi")])
            assert httpx.get(f"{running.url}/health").json()["status"] == "ok"
    finally:
        served.failure = None


def test_many_clients_at_once(served, chat, media_dir, tmp_path):
    """8 clients, each a 10-question conversation (one with an image, some streamed): every answer equals Chat's for
    that client's conversation, in order; with room for every client in the queue, none is refused."""
    clients, rounds = 8, 10
    questions = {c: [(f"Client {c}, question {r}.", (media_dir / IMAGE,) if c == 0 and r == 0 else (), ())
                     for r in range(rounds)] for c in range(clients)}
    expected = {c: ask_chat(chat, questions[c], max_new_tokens=3) for c in range(clients)}
    got: dict[int, list[Answer]] = {c: [] for c in range(clients)}
    failures: list[BaseException] = []

    def converse(c: int, client: openai.OpenAI) -> None:
        messages: list[dict] = []
        try:
            for r, (text, images, audios) in enumerate(questions[c]):
                messages.append(user(text, images, audios))
                answer = ask_server(client, messages, stream=(c + r) % 3 == 0, max_tokens=3)
                got[c].append(answer)
                messages.append({"role": "assistant", "content": answer.text})
        except BaseException as exc:
            failures.append(exc)

    with running_server(served, tmp_path, max_queue=clients) as running:
        threads = [threading.Thread(target=converse, args=(c, running.client())) for c in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not failures, failures[0]
    assert got == expected


def test_full_queue_answers_429(served, chat, tmp_path):
    """max_queue=1: one request being answered (held at the gate), one waiting; the third is refused with 429, and the
    first two are answered correctly once the gate opens."""
    results: dict[str, Answer | BaseException] = {}

    def send(name: str, client: openai.OpenAI) -> None:
        try:
            results[name] = ask_server(client, [user(f"Request {name}.")])
        except BaseException as exc:
            results[name] = exc

    served.gate.clear()
    try:
        with running_server(served, tmp_path, max_queue=1) as running:
            health = lambda: httpx.get(f"{running.url}/health").json()  # noqa: E731
            first = threading.Thread(target=send, args=("A", running.client()))
            first.start()
            wait_for(lambda: health()["busy"], "the first request to be answered")
            second = threading.Thread(target=send, args=("B", running.client()))
            second.start()
            wait_for(lambda: health()["waiting"] == 1, "the second request to wait")
            with pytest.raises(openai.RateLimitError) as refused:
                ask_server(running.client(), [user("Request C.")])
            assert refused.value.code == "queue_full"
            served.gate.set()
            first.join(timeout=30)
            second.join(timeout=30)
            assert ask_server(running.client(), [user("Request C.")]) == ask_chat(chat, [("Request C.", (), ())])[0]
    finally:
        served.gate.set()
    for name in ("A", "B"):
        assert results[name] == ask_chat(chat, [(f"Request {name}.", (), ())])[0]


def test_disconnect_stops_generation(server, served, chat):
    long = 3000  # ~15 s of tokens: a disconnect must end it long before
    body = {"model": server.routes.model_id, "messages": [user("Talk for a long time.")], "max_tokens": long,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data: ")) > 2
    health = lambda: httpx.get(f"{server.url}/health").json()  # noqa: E731
    wait_for(lambda: not health()["busy"], "the stream to stop", timeout=10)
    assert last_stats(server.routes).new_tokens < long / 2

    # A non-streamed request whose client gives up is stopped as well.
    with pytest.raises(openai.APITimeoutError):
        ask_server(server.client(timeout=0.5), [user("Talk for a long time.")], max_tokens=long)
    wait_for(lambda: not health()["busy"], "the request to stop", timeout=10)
    assert last_stats(server.routes).new_tokens < long / 2
    assert ask_server(server.client(), [user("Hello!")]) == ask_chat(chat, [("Hello!", (), ())])[0]
