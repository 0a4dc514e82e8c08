// Attachments as the server takes them: pictures as data: URLs of PNG or JPEG (other kinds are redrawn as PNG), sound
// as base64 WAV, MP3 or FLAC. Other sound files, and the microphone's recording (WebM or Ogg in browsers), are decoded
// here and written as 16-bit PCM WAV, mono, at 16 kHz (the rate the speech encoder works at).

const IMAGE_TYPES = new Set(["image/png", "image/jpeg"]);
const AUDIO_FORMATS = {
  "audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav",
  "audio/mpeg": "mp3", "audio/mp3": "mp3", "audio/flac": "flac", "audio/x-flac": "flac",
};
const AUDIO_EXTENSIONS = { wav: "wav", mp3: "mp3", flac: "flac" };
export const SAMPLE_RATE = 16000;

/** `file` as an attachment: {kind: "image", name, url} or {kind: "audio", name, format, data (base64)}. */
export async function attachment(file) {
  const name = file.name || (file.type.startsWith("image/") ? "pasted picture" : "sound");
  if (file.type.startsWith("image/")) {
    return { kind: "image", name, url: await dataUrl(IMAGE_TYPES.has(file.type) ? file : await toPng(file, name)) };
  }
  const format = AUDIO_FORMATS[file.type] ?? AUDIO_EXTENSIONS[name.split(".").pop().toLowerCase()];
  if (format) return { kind: "audio", name, format, data: base64(await dataUrl(file)) };
  if (file.type.startsWith("audio/") || file.type.startsWith("video/")) return wavAttachment(await toWav(file, name), name);
  throw new Error(`${name}: not a picture nor a sound file`);
}

/** The microphone, recorded until stop(). */
export class Recorder {
  get recording() {
    return this.recorder?.state === "recording";
  }

  async start() {
    if (!navigator.mediaDevices?.getUserMedia) {
      throw new Error("recording needs the page served over https or from localhost");
    }
    this.stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    this.chunks = [];
    this.started = new Date();
    this.recorder = new MediaRecorder(this.stream);
    this.recorder.addEventListener("dataavailable", (event) => event.data.size && this.chunks.push(event.data));
    this.recorder.start();
  }

  /** The recording as a WAV attachment. */
  async stop() {
    const stopped = new Promise((resolve) => this.recorder.addEventListener("stop", resolve, { once: true }));
    this.recorder.stop();
    await stopped;
    for (const track of this.stream.getTracks()) track.stop();
    const name = `recording ${this.started.toLocaleTimeString()}.wav`;
    return wavAttachment(await toWav(new Blob(this.chunks, { type: this.recorder.mimeType }), name), name);
  }
}

/** 16-bit PCM WAV of mono `samples` (floats in -1..1) at `rate`. */
export function encodeWav(samples, rate = SAMPLE_RATE) {
  const view = new DataView(new ArrayBuffer(44 + 2 * samples.length));
  const text = (offset, value) => [...value].forEach((c, i) => view.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF");
  view.setUint32(4, 36 + 2 * samples.length, true);
  text(8, "WAVE");
  text(12, "fmt ");
  view.setUint32(16, 16, true); // the format chunk's size
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // one channel
  view.setUint32(24, rate, true);
  view.setUint32(28, 2 * rate, true); // bytes per second
  view.setUint16(32, 2, true); // bytes per frame
  view.setUint16(34, 16, true); // bits per sample
  text(36, "data");
  view.setUint32(40, 2 * samples.length, true);
  samples.forEach((sample, i) => {
    const clipped = Math.max(-1, Math.min(1, sample));
    view.setInt16(44 + 2 * i, Math.round(clipped < 0 ? clipped * 0x8000 : clipped * 0x7fff), true);
  });
  return new Blob([view], { type: "audio/wav" });
}

async function wavAttachment(wav, name) {
  return { kind: "audio", name, format: "wav", data: base64(await dataUrl(wav)) };
}

/** `blob` (any sound the browser decodes) as WAV, mono at SAMPLE_RATE. */
async function toWav(blob, name) {
  let decoded;
  try {
    // decoding in a context at SAMPLE_RATE resamples to it
    decoded = await new OfflineAudioContext(1, 1, SAMPLE_RATE).decodeAudioData(await blob.arrayBuffer());
  } catch {
    throw new Error(`${name}: this browser cannot decode the sound`);
  }
  const mono = new Float32Array(decoded.length);
  for (let channel = 0; channel < decoded.numberOfChannels; channel++) {
    decoded.getChannelData(channel).forEach((sample, i) => { mono[i] += sample / decoded.numberOfChannels; });
  }
  return encodeWav(mono, SAMPLE_RATE);
}

/** `blob` (any picture the browser decodes) redrawn as PNG. */
async function toPng(blob, name) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(blob);
  } catch {
    throw new Error(`${name}: this browser cannot read the picture`);
  }
  const canvas = document.createElement("canvas");
  canvas.width = bitmap.width;
  canvas.height = bitmap.height;
  canvas.getContext("2d").drawImage(bitmap, 0, 0);
  bitmap.close();
  return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
}

function dataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

function base64(url) {
  return url.slice(url.indexOf(",") + 1);
}
