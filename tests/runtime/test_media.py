"""builder_plugin.runtime.media: the files an app names, decoded safely; onnxruntime-genai reads the canonical bytes
as it reads the files themselves."""

from __future__ import annotations

import numpy as np
import onnxruntime_genai as og
import pytest

from builder_plugin.runtime import (
    MediaNotFoundError,
    UnsupportedMediaError,
    og_audios,
    og_images,
    open_audio,
    open_image,
)

IMAGE = "square.png"
AUDIO = "clip_2s.wav"


def test_files_open_as_media_and_errors_are_the_runtimes(media_dir, tmp_path):
    image, clip = open_image(media_dir / IMAGE), open_audio(media_dir / AUDIO)
    assert (image.kind, image.source, image.info["format"]) == ("image", str(media_dir / IMAGE), "PNG")
    assert (clip.kind, clip.info["seconds"]) == ("audio", 2.0)
    assert open_image(image) is image  # decoded media pass through
    with pytest.raises(UnsupportedMediaError, match="an image was expected, not an audio clip"):
        open_image(clip)
    with pytest.raises(MediaNotFoundError, match="image file not found: .*missing.png"):
        open_image(tmp_path / "missing.png")
    with pytest.raises(MediaNotFoundError, match="audio path is not a file"):
        open_audio(tmp_path)
    disguised = tmp_path / "sound.png"
    disguised.write_bytes((media_dir / AUDIO).read_bytes())
    with pytest.raises(UnsupportedMediaError, match=r"cannot read image .*sound.png: not a readable image \(not a "):
        open_image(disguised)
    with pytest.raises(UnsupportedMediaError, match=r"cannot read audio .*square.png: not a readable audio clip"):
        open_audio(media_dir / IMAGE)


def test_the_processor_reads_canonical_bytes_as_it_reads_the_files(tiny_package, media_dir):
    """PNG and 16-bit WAV files are already canonical: the processor gives the same tensors for both."""
    processor = og.Model(str(tiny_package)).create_multimodal_processor()
    prompt = "<|user|><|image_1|><|audio_1|>?<|end|><|assistant|>"
    direct = processor(prompt, images=og.Images.open(str(media_dir / IMAGE)),
                       audios=og.Audios.open(str(media_dir / AUDIO)))
    canonical = processor(prompt, images=og_images([open_image(media_dir / IMAGE)]),
                          audios=og_audios([open_audio(media_dir / AUDIO)]))
    for name in ("pixel_values", "image_sizes", "audio_embeds", "input_ids"):
        assert np.array_equal(direct[name].as_numpy(), canonical[name].as_numpy()), name
    assert og_images([]) is None and og_audios([]) is None


def test_a_fit_to_the_packages_crop_gives_the_model_one_crop(tiny_package, tiny_checkpoint, tmp_path):
    """Package.crop_side is the checkpoint's crop size; an image opened with that fit (a file, or media already
    decoded) is read as one crop and the global view, where the whole photo takes several crops."""
    import io
    import json

    from PIL import Image
    from skimage import data as photographs

    from builder_plugin.runtime import Package
    from builder_plugin.runtime.package import crop_side

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    crop = config["embd_layer"]["image_embd_layer"]["crop_size"]
    assert Package(tiny_package).crop_side == crop
    # another builder's processor, or none: no crop size, and the package still opens
    other = tmp_path / "vision_processor.json"
    other.write_text(json.dumps({"processor": {"transforms": [{"operation": {"type": "Resize", "attrs": {}}}]}}))
    assert crop_side(tmp_path, {"vision": {"config_filename": other.name}}) is None
    assert crop_side(tmp_path, {"vision": {"config_filename": "missing.json"}}) is None
    assert crop_side(tmp_path, {}) is None
    photo = tmp_path / "photo.jpg"
    Image.fromarray(photographs.astronaut()).resize((1200, 800)).save(photo)
    fitted = open_image(photo, fit=crop)
    assert Image.open(io.BytesIO(fitted.data)).size == (crop, round(800 * crop / 1200))
    assert open_image(open_image(photo), fit=crop) == fitted and open_image(fitted, fit=crop) == fitted
    processor = og.Model(str(tiny_package)).create_multimodal_processor()
    prompt = "<|user|><|image_1|>?<|end|><|assistant|>"
    whole = processor(prompt, images=og_images([open_image(photo)]))["pixel_values"].as_numpy()
    one = processor(prompt, images=og_images([fitted]))["pixel_values"].as_numpy()
    assert one.shape[1] == 2 and whole.shape[1] > 2  # crops and the global view, [batch, crops, 3, side, side]


def test_the_shortest_clip_accepted_is_answered_and_a_shorter_one_refused(tiny_package, tmp_path):
    """Clips of 5-15 ms end the process inside onnxruntime-genai's feature extractor (SIGFPE): the limit refuses
    them, and a clip of the shortest accepted length goes through the whole pipeline at every kind of rate."""
    from builder_plugin.media import MediaLimits
    from builder_plugin.runtime import Chat
    from builder_plugin.testing.media import make_wav

    shortest = MediaLimits().min_audio_seconds
    chat = Chat(tiny_package)
    for rate in (8000, 11025, 16000, 44100):
        clip = make_wav(tmp_path / f"short-{rate}.wav", shortest, sample_rate=rate)
        assert list(chat.ask("What is this?", audios=[clip], max_new_tokens=1)), rate
        chat.clear()
    with pytest.raises(UnsupportedMediaError, match=r"click.wav: the clip is too short \(0.01 s; at least 0.1 s\)"):
        chat.ask("What is this?", audios=[make_wav(tmp_path / "click.wav", 0.01)])
