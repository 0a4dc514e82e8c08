"""The chat page (builder_plugin/serve/page.py and ui/): served without a key under a strict Content-Security-Policy,
off with --no-ui, and used in a real browser (Chromium) against a server on the tiny package: the answers it
assembles from the stream equal a Chat's run independently on the same package."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest

from builder_plugin.runtime import Chat
from builder_plugin.serve.__main__ import make_parser
from builder_plugin.serve.page import FOLDER
from tests.support.serving import ask_chat, last_stats, running_server

KEY = "page-test-key"
TOKENS = 100  # max tokens of the page's questions: ~0.5 s of streaming on the tiny package
LONG = 3000  # of the answer that is stopped: far more than it gets before the stop
IMAGE = "square.png"
CLIP = "clip_2s.wav"
# Screenshots go to the test's folder (removed after a passing run), and to this folder too when it is set.
SCREENSHOTS_VARIABLE = "BUILDER_PLUGIN_SCREENSHOTS"


@pytest.fixture(scope="module")
def chat(tiny_package) -> Chat:
    """The yardstick: a Chat of its own on the same package."""
    return Chat(tiny_package)


# ---- the files and their headers ----------------------------------------------------------------------------------


def referenced_files() -> set[str]:
    """The files the page loads: its HTML's src/href and its modules' imports, followed from index.html."""
    found, queue = set(), ["index.html"]
    while queue:
        text = (FOLDER / queue.pop()).read_text()
        for name in re.findall(r'(?:src|href)="ui/([\w.-]+)"|from "\./([\w.-]+)"', text):
            name = "".join(name)
            if name not in found:
                found.add(name)
                queue.append(name)
    return found


def test_the_page_is_served_without_a_key_and_loads_only_itself(served, tmp_path):
    files = referenced_files()
    assert {"app.js", "chat.css", "markdown.js", "api.js", "media.js", "store.js"} <= files
    with running_server(served, tmp_path, api_keys=[KEY]) as running:
        page = httpx.get(f"{running.url}/")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        policy = dict(rule.strip().split(" ", 1) for rule in page.headers["content-security-policy"].split(";"))
        assert policy["default-src"] == "'none'" and policy["script-src"] == "'self'"
        assert policy["connect-src"] == "'self'" and policy["frame-ancestors"] == "'none'"
        assert policy["img-src"] == policy["media-src"] == "'self' data: blob:"
        assert page.headers["x-content-type-options"] == "nosniff"
        types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
        for name in files:
            asset = httpx.get(f"{running.url}/ui/{name}")
            assert asset.status_code == 200, name
            assert asset.headers["content-type"].split(";")[0] == types[Path(name).suffix], name
            assert asset.content == (FOLDER / name).read_bytes()
            again = httpx.get(f"{running.url}/ui/{name}", headers={"If-None-Match": asset.headers["etag"]})
            assert again.status_code == 304 and not again.content
        assert httpx.head(f"{running.url}/").status_code == 200
        # the API still needs the key; a path under /ui/ that is not a file of the page too
        assert httpx.get(f"{running.url}/v1/models").status_code == 401
        assert httpx.get(f"{running.url}/ui/secret.txt").status_code == 401
    with running_server(served, tmp_path) as running:
        missing = httpx.get(f"{running.url}/ui/nothing.js")
        assert missing.status_code == 404 and missing.json()["error"]["message"].endswith("nothing.js")
        assert httpx.get(f"{running.url}/ui/index.html").status_code == 404  # the page is at / only


def test_no_ui(served, tmp_path):
    assert make_parser().parse_args(["pkg", "--no-ui"]).ui is False
    assert make_parser().parse_args(["pkg"]).ui is True
    with running_server(served, tmp_path, ui=False) as running:
        for path in ("/", "/ui/app.js"):
            response = httpx.get(running.url + path)
            assert response.status_code == 404 and response.json()["error"]["type"] == "invalid_request_error"
        assert httpx.get(f"{running.url}/health").status_code == 200


# ---- in a browser -------------------------------------------------------------------------------------------------


def by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def screenshot(driver, folder: Path, name: str) -> None:
    paths = [folder / name]
    if os.environ.get(SCREENSHOTS_VARIABLE):
        paths.append(Path(os.environ[SCREENSHOTS_VARIABLE]) / name)
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
    for path in paths:
        assert driver.save_screenshot(str(path)), path
    print(f"screenshot: {', '.join(map(str, paths))}")


def wait_until(condition, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stored(driver) -> list[dict]:
    """The conversations the page keeps in localStorage, the most recent first."""
    return json.loads(driver.execute_script("return localStorage.getItem('builder_plugin.chat.conversations')"))


def answers(driver) -> list[tuple[str, int]]:
    """(state, length of the shown text) of every answer on the page."""
    return driver.execute_script("return [...document.querySelectorAll('#messages article.assistant')]"
                                 ".map(a => [a.dataset.state, a.querySelector('.text').textContent.length])")


def settings(driver, **values: str) -> None:
    by_id(driver, "open-settings").click()
    for element_id, value in values.items():
        field = by_id(driver, element_id.replace("_", "-"))
        field.clear()
        field.send_keys(value)
    by_id(driver, "save-settings").click()


def ask(driver, text: str) -> None:
    """Type `text` and press Enter; return once its answer has finished (recording what the page showed meanwhile
    in window.seen: the state and shown length of the answer at each change of the page)."""
    from selenium.webdriver.common.keys import Keys

    before = len(answers(driver))
    driver.execute_script("window.seen = []")
    by_id(driver, "question").send_keys(text, Keys.ENTER)
    wait_until(lambda: len(answers(driver)) == before + 1 and answers(driver)[-1][0] != "streaming",
               f"the answer to {text!r}")


def grew_while_streaming(driver) -> list[int]:
    """The lengths the streaming answer was shown at, in order (window.seen, without repeats)."""
    lengths = [length for state, length, _ in driver.execute_script("return window.seen") if state == "streaming"]
    return [n for i, n in enumerate(lengths) if i == 0 or n != lengths[i - 1]]


WATCH = """
new MutationObserver(() => {
  const shown = [...document.querySelectorAll('#messages article.assistant')].pop();
  if (shown && window.seen) window.seen.push([shown.dataset.state, shown.querySelector('.text').textContent.length,
                                              shown.querySelector('.meta').textContent]);
}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true,
                                                 attributes: true});
"""


def test_chat_in_a_browser(browser, served, chat, media_dir, tmp_path):
    """A person's session: the key, a text question, a picture, a recording, a stopped answer, two conversations kept
    across a reload, a narrow screen; screenshots in the test's folder (and in $BUILDER_PLUGIN_SCREENSHOTS)."""
    from selenium.webdriver.common.by import By

    driver = browser
    image, clip = media_dir / IMAGE, media_dir / CLIP
    driver.get_log("browser")  # what earlier tests left in the console
    with running_server(served, tmp_path, api_keys=[KEY]) as running:
        driver.get(f"{running.url}/")
        notice = wait_until(lambda: by_id(driver, "notice").is_displayed() and by_id(driver, "notice").text,
                            "the key notice")
        assert "needs an API key" in notice
        settings(driver, api_key=KEY, max_tokens=str(TOKENS), temperature="0")
        wait_until(lambda: by_id(driver, "model").text == running.routes.model_id, "the model's name")
        assert not by_id(driver, "notice").is_displayed()
        driver.execute_script(WATCH)

        # a text question: streamed in, shown growing, assembled as the server's Chat answers it
        ask(driver, "What is a lighthouse?")
        grew = grew_while_streaming(driver)
        assert len(grew) >= 3 and grew == sorted(grew), grew
        first, = stored(driver)
        question, reply = first["messages"]
        assert question == {"role": "user", "content": "What is a lighthouse?"}
        expected = ask_chat(chat, [("What is a lighthouse?", (), ())], max_new_tokens=TOKENS)
        assert reply["content"] == expected[0].text and reply["meta"]["state"] == "done"
        assert reply["meta"]["usage"]["completion_tokens"] == expected[0].completion_tokens
        assert first["title"] == "What is a lighthouse?"
        # before its first word the answer says how long it has waited; then how long that took
        waited = [meta for state, length, meta in driver.execute_script("return window.seen")
                  if state == "streaming" and length == 0]
        assert waited and all(re.fullmatch(r"waiting for the first word · \d+ s", meta) for meta in waited), waited
        assert 0 < reply["meta"]["firstWord"] <= reply["meta"]["seconds"] and "started" not in reply["meta"]
        shown_meta = driver.execute_script("return [...document.querySelectorAll('#messages article.assistant')]"
                                           ".pop().querySelector('.meta').textContent")
        shown_wait = re.search(r"first word after (\d+\.\d) s$", shown_meta)
        assert shown_wait and abs(float(shown_wait[1]) - reply["meta"]["firstWord"]) <= 0.051, shown_meta
        meta = reply["meta"]
        rate = (meta["usage"]["completion_tokens"] - 1) / (meta["seconds"] - meta["firstWord"])
        shown_rate = re.search(r"· (\d+\.\d) tokens/s", shown_meta)
        assert shown_rate and abs(float(shown_rate[1]) - rate) <= 0.051, (shown_meta, rate)

        # a picture and a clip attached through the file input: sent as they are, answered in the same conversation
        for path in (image, clip):
            by_id(driver, "attach").send_keys(str(path))
            wait_until(lambda name=path.name: name in by_id(driver, "attachments").text, f"{path.name} attached")
        ask(driver, "Describe the picture and the sound.")
        messages = stored(driver)[0]["messages"]
        picture, sound, text = messages[2]["content"]
        assert picture["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        assert sound["input_audio"] == {"data": base64.b64encode(clip.read_bytes()).decode(), "format": "wav"}
        assert text == {"type": "text", "text": "Describe the picture and the sound."}
        expected = ask_chat(chat, [("What is a lighthouse?", (), ()),
                                   ("Describe the picture and the sound.", (image,), (clip,))], max_new_tokens=TOKENS)
        assert messages[3]["content"] == expected[1].text and messages[3]["meta"]["state"] == "done"
        assert driver.find_elements(By.CSS_SELECTOR, "#messages article.user img")
        assert driver.find_elements(By.CSS_SELECTOR, "#messages article.user audio")
        screenshot(driver, tmp_path, "chat.png")

        # the microphone (Chromium's fake one: a beep), sent as 16-bit PCM WAV, mono, 16 kHz
        by_id(driver, "record").click()
        wait_until(lambda: by_id(driver, "record").get_attribute("aria-pressed") == "true", "the recording")
        time.sleep(1.5)
        by_id(driver, "record").click()
        wait_until(lambda: "recording" in by_id(driver, "attachments").text, "the recording's attachment")
        ask(driver, "What do you hear?")
        messages = stored(driver)[0]["messages"]
        assert messages[5]["meta"]["state"] == "done", messages[5]["meta"]
        sound = messages[4]["content"][0]["input_audio"]
        assert sound["format"] == "wav"
        with wave.open(io.BytesIO(base64.b64decode(sound["data"]))) as clip:
            assert (clip.getnchannels(), clip.getsampwidth(), clip.getframerate()) == (1, 2, 16000)
            assert 0.8 < clip.getnframes() / 16000 < 5
            samples = np.frombuffer(clip.readframes(clip.getnframes()), np.int16)
        assert np.abs(samples).max() > 1000  # the beep, not silence

        # a new conversation, its long answer stopped: the server stops generating at once
        by_id(driver, "new-chat").click()
        assert not driver.find_elements(By.CSS_SELECTOR, "#messages article")
        settings(driver, max_tokens=str(LONG))
        by_id(driver, "question").send_keys("Talk for a long time.\n")
        wait_until(lambda: answers(driver) and answers(driver)[-1][1] > 0, "the long answer to start")
        by_id(driver, "stop").click()
        wait_until(lambda: answers(driver)[-1][0] == "stopped", "the answer to stop", timeout=5)
        wait_until(lambda: not running.routes.worker.busy, "the server to stop generating", timeout=5)
        assert last_stats(running.routes).new_tokens < LONG / 2
        assert not by_id(driver, "stop").is_displayed() and by_id(driver, "send").is_enabled()
        talk = stored(driver)[0]
        assert talk["messages"][1]["meta"]["state"] == "stopped" and talk["messages"][1]["content"]

        # both conversations kept: switch, and find them again after a reload
        def conversations():
            return [b.text for b in driver.find_elements(By.CSS_SELECTOR, "#conversation-list .open")]

        assert conversations() == ["Talk for a long time.", "What is a lighthouse?"]
        driver.find_elements(By.CSS_SELECTOR, "#conversation-list .open")[1].click()
        shown = [a.find_element(By.CLASS_NAME, "text").text
                 for a in driver.find_elements(By.CSS_SELECTOR, "#messages article.user")]
        assert shown == ["What is a lighthouse?", "Describe the picture and the sound.", "What do you hear?"]
        assert [state for state, _ in answers(driver)] == ["done"] * 3
        driver.refresh()
        wait_until(lambda: by_id(driver, "model").text == running.routes.model_id, "the page to load again")
        assert conversations() == ["Talk for a long time.", "What is a lighthouse?"]  # the last one answered first
        assert [state for state, _ in answers(driver)] == ["stopped"]

        # a narrow screen: the list folds away behind a button
        driver.set_window_size(390, 844)
        try:
            assert not by_id(driver, "conversations").is_displayed()
            by_id(driver, "toggle-list").click()
            assert by_id(driver, "conversations").is_displayed()
            screenshot(driver, tmp_path, "narrow.png")
            driver.find_elements(By.CSS_SELECTOR, "#conversation-list .open")[1].click()
            assert not by_id(driver, "conversations").is_displayed()
            assert [state for state, _ in answers(driver)] == ["done"] * 3
        finally:
            driver.set_window_size(1100, 800)

        # deleted, after a confirmation
        driver.find_elements(By.CSS_SELECTOR, "#conversation-list .delete")[0].click()
        driver.switch_to.alert.accept()
        assert conversations() == ["What is a lighthouse?"] and [c["title"] for c in stored(driver)] == conversations()
    # no script error and nothing the Content-Security-Policy blocked (network: the 401 of the first, keyless call)
    console = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert all(entry["source"] == "network" and " 401 " in entry["message"] for entry in console), console


def test_pictures_at_low_detail(browser, served, chat, tmp_path):
    """The Pictures setting: a photo attached at low detail is sent with detail "low" (kept with its message) and
    answered as Chat answers it fitted to one crop."""
    from PIL import Image
    from selenium.webdriver.support.ui import Select
    from skimage import data as photographs

    from builder_plugin.runtime import open_image

    driver = browser
    photo = tmp_path / "photo.png"
    Image.fromarray(photographs.astronaut()).resize((1000, 700)).save(photo)
    with running_server(served, tmp_path) as running:
        driver.get(f"{running.url}/")
        wait_until(lambda: by_id(driver, "model").text == running.routes.model_id, "the model's name")
        by_id(driver, "new-chat").click()
        by_id(driver, "open-settings").click()
        Select(by_id(driver, "image-detail")).select_by_value("low")
        for element_id, value in (("max-tokens", str(TOKENS)), ("temperature", "0")):
            by_id(driver, element_id).clear()
            by_id(driver, element_id).send_keys(value)
        by_id(driver, "save-settings").click()
        by_id(driver, "attach").send_keys(str(photo))
        wait_until(lambda: photo.name in by_id(driver, "attachments").text, "the photo attached")
        ask(driver, "What is in this picture?")
        question, reply = stored(driver)[0]["messages"]
        assert question["content"][0]["image_url"]["detail"] == "low"
        fitted = open_image(photo, fit=served.package.crop_side)
        expected, = ask_chat(chat, [("What is in this picture?", (fitted,), ())], max_new_tokens=TOKENS)
        assert reply["content"] == expected.text and reply["meta"]["state"] == "done"
        assert reply["meta"]["usage"]["prompt_tokens"] == expected.prompt_tokens
        by_id(driver, "open-settings").click()
        assert Select(by_id(driver, "image-detail")).first_selected_option.get_attribute("value") == "low"
        Select(by_id(driver, "image-detail")).select_by_value("")
        by_id(driver, "save-settings").click()


def test_errors_are_shown_with_the_answer(browser, served, tmp_path):
    """The server's OpenAI error is shown inline; the failed answer is not sent back with the next question."""
    driver = browser
    with running_server(served, tmp_path, api_keys=[KEY]) as running:
        driver.get(f"{running.url}/")
        settings(driver, api_key="not-the-key", max_tokens="4")
        wait_until(lambda: "Incorrect API key" in by_id(driver, "notice").text, "the key notice")
        ask(driver, "Hello")
        assert answers(driver)[-1][0] == "error"
        error = driver.execute_script("return document.querySelector('#messages article.assistant .error').textContent")
        assert error == "Incorrect API key provided"
        settings(driver, api_key=KEY)
        wait_until(lambda: by_id(driver, "model").text == running.routes.model_id, "the model's name")
        ask(driver, "Hello again")
        assert answers(driver)[-1][0] == "done"
        assert [m["role"] for m in stored(driver)[0]["messages"]] == ["user", "assistant", "user", "assistant"]


MARKDOWN = """<img src=x onerror="window.hacked=1"> **bold** and *it* with `code <b>` and <script>hacked=2</script>
[fine](https://example.com/a?b=1) [bad](javascript:window.hacked=3) see https://example.org.

```html
<script>window.hacked=4</script>
```

- one
- two with **more**

3. three
4. four

> quoted _words_
"""

RENDER = """
const [text, done] = arguments;
import('./ui/markdown.js').then(({render}) => {
  const root = document.createElement('div');
  root.append(render(text));
  document.body.append(root);
  const all = (selector) => [...root.querySelectorAll(selector)];
  done({tags: [...new Set(all('*').map(e => e.localName))].sort(), strong: all('strong').map(e => e.textContent),
        em: all('em').map(e => e.textContent), code: all(':not(pre) > code').map(e => e.textContent),
        pre: all('pre code').map(e => [e.className, e.textContent]),
        links: all('a').map(e => [e.textContent, e.href, e.rel, e.target]),
        items: all('li').map(e => e.textContent), start: all('ol').map(e => e.start),
        first: root.querySelector('p').textContent, hacked: window.hacked ?? null});
});
"""


def test_markdown_shows_markup_as_text(browser, served, tmp_path):
    driver = browser
    with running_server(served, tmp_path) as running:
        driver.get(f"{running.url}/")
        shown = driver.execute_async_script(RENDER, MARKDOWN)
    assert shown["hacked"] is None
    assert shown["tags"] == ["a", "blockquote", "br", "code", "em", "li", "ol", "p", "pre", "strong", "ul"]
    assert shown["first"].startswith('<img src=x onerror="window.hacked=1"> bold and it with code <b> and <script>')
    assert shown["strong"] == ["bold", "more"] and shown["em"] == ["it", "words"]
    assert shown["code"] == ["code <b>"] and shown["pre"] == [["language-html", "<script>window.hacked=4</script>"]]
    assert shown["links"] == [["fine", "https://example.com/a?b=1", "noopener noreferrer", "_blank"],
                              ["https://example.org", "https://example.org/", "noopener noreferrer", "_blank"]]
    assert "[bad](javascript:window.hacked=3)" in shown["first"]
    assert shown["items"] == ["one", "two with more", "three", "four"] and shown["start"] == [3]


ENCODE = """
const [samples, rate, done] = arguments;
import('./ui/media.js').then(async ({encodeWav}) => {
  const bytes = new Uint8Array(await encodeWav(Float32Array.from(samples), rate).arrayBuffer());
  done(btoa(String.fromCharCode(...bytes)));
});
"""


def test_wav_encoder(browser, served, tmp_path):
    """The page's WAV (what a recording is sent as), read back by Python's wave module."""
    samples = np.concatenate([np.sin(np.arange(800) * 2 * np.pi * 440 / 16000) * 0.5, [1.5, -1.5, 1.0, -1.0, 0.0]])
    with running_server(served, tmp_path) as running:
        browser.get(f"{running.url}/")
        encoded = base64.b64decode(browser.execute_async_script(ENCODE, samples.tolist(), 16000))
    with wave.open(io.BytesIO(encoded)) as clip:
        assert (clip.getnchannels(), clip.getsampwidth(), clip.getframerate(), clip.getnframes()) == (1, 2, 16000,
                                                                                                      len(samples))
        got = np.frombuffer(clip.readframes(len(samples)), "<i2")
    clipped = np.clip(samples.astype(np.float32).astype(np.float64), -1, 1)  # the page's samples are float32
    expected = np.floor(np.where(clipped < 0, clipped * 32768, clipped * 32767) + 0.5).astype(np.int16)  # Math.round
    np.testing.assert_array_equal(got, expected)
