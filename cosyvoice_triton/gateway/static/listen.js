// The listening page: text to speech (POST /v1/audio/speech, a streamed wav) and voice conversion (POST
// /inference_vc: source_wav, and spk_id or prompt_wav; streamed 16-bit PCM at x-sample-rate), played through Web
// Audio as the bytes arrive, then offered as a WAV file.
// Prompts and sources (uploaded or recorded) are decoded by the browser and sent as 16-bit mono WAV at 16 kHz, the
// rate at which CosyVoice's own front end reads them.
"use strict";

const SPEECH_PATH = "/v1/audio/speech";
const VOICES_PATH = "/v1/audio/voices";
const VC_PATH = "/inference_vc";
const VC_RATE = 24000; // CosyVoice 2's output rate: the rate of /inference_vc's raw PCM unless it says otherwise
const MAX_RECORD_S = 30;
const UPLOAD_RATE = 16000;
const LEAD_S = 0.15; // how far ahead of "now" a chunk that arrives after an underrun starts

const $ = (id) => document.getElementById(id);

// What the page is doing, for people (the status line) and for tests (window.listenState).
const state = window.listenState = {
  voices: null, voicesError: "", prompt: null, source: null, recording: "", recordedS: 0,
  runs: 0, busy: "", received: 0, chunks: 0, scheduled: 0, sampleRate: 0, done: false, error: "", result: null,
};

let audioCtx = null;
function audioContext() {
  if (!audioCtx) audioCtx = new AudioContext({ sampleRate: 24000 });
  return audioCtx;
}

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const key = $("key").value.trim();
  if (key) h.authorization = "Bearer " + key;
  return h;
}

async function failure(resp) {
  let msg = `${resp.status} ${resp.statusText}`;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) msg = `${resp.status}: ${body.error.message}`;
    else if (body && body.detail) msg = `${resp.status}: ${JSON.stringify(body.detail)}`;
  } catch (e) { /* not JSON */ }
  if (resp.status === 401) msg += " (enter the API key above)";
  return new Error(msg);
}

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = kind || "";
}

function kB(n) { return (n / 1000).toFixed(1) + " kB"; }

// ------------------------------------------------------------------------------------------------ voices
async function loadVoices() {
  const select = $("voice");
  const note = $("voices-note");
  note.textContent = "loading…";
  try {
    const resp = await fetch(VOICES_PATH, { headers: authHeaders() });
    if (!resp.ok) throw await failure(resp);
    const ids = (await resp.json()).data.map((v) => v.id);
    const keep = select.value;
    select.replaceChildren(...ids.map((id) => new Option(id, id, false, id === keep)));
    state.voices = ids;
    state.voicesError = "";
    note.textContent = ids.length ? `${ids.length} registered` : "none registered: use prompt audio";
  } catch (e) {
    select.replaceChildren();
    state.voices = [];
    state.voicesError = e.message;
    note.textContent = e.message;
  }
}

// ------------------------------------------------------------------------------------------------ WAV
function wavHeader(samples, rate) {
  const b = new DataView(new ArrayBuffer(44));
  const text = (at, s) => { for (let i = 0; i < 4; i++) b.setUint8(at + i, s.charCodeAt(i)); };
  text(0, "RIFF"); b.setUint32(4, 36 + samples * 2, true); text(8, "WAVE");
  text(12, "fmt "); b.setUint32(16, 16, true); b.setUint16(20, 1, true); b.setUint16(22, 1, true);
  b.setUint32(24, rate, true); b.setUint32(28, rate * 2, true); b.setUint16(32, 2, true); b.setUint16(34, 16, true);
  text(36, "data"); b.setUint32(40, samples * 2, true);
  return b.buffer;
}

// Where the samples of a (streamed) 16-bit wav start; null while more bytes are needed.
function parseWavHeader(u8) {
  if (u8.length < 12) return null;
  const dv = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  const tag = (at) => String.fromCharCode(u8[at], u8[at + 1], u8[at + 2], u8[at + 3]);
  if (tag(0) !== "RIFF" || tag(8) !== "WAVE") throw new Error("the answer is not a wav file");
  let at = 12;
  let fmt = null;
  while (at + 8 <= u8.length) {
    const id = tag(at);
    const size = dv.getUint32(at + 4, true);
    if (id === "data") {
      if (!fmt) throw new Error("wav: data before fmt");
      return { rate: fmt.rate, offset: at + 8 };
    }
    if (at + 8 + size > u8.length) return null;
    if (id === "fmt ") {
      fmt = { format: dv.getUint16(at + 8, true), channels: dv.getUint16(at + 10, true),
              rate: dv.getUint32(at + 12, true), bits: dv.getUint16(at + 22, true) };
      if (fmt.format !== 1 || fmt.channels !== 1 || fmt.bits !== 16) {
        throw new Error("wav: expected 16-bit mono PCM");
      }
    }
    at += 8 + size + (size & 1);
  }
  return null;
}

// Any audio the browser decodes (wav, flac, mp3, ogg, webm) -> {wav: Blob (16-bit mono at UPLOAD_RATE), seconds}.
async function toWav(blob) {
  // an offline context's decodeAudioData resamples to the context's rate
  const decoded = await new OfflineAudioContext(1, 1, UPLOAD_RATE).decodeAudioData(await blob.arrayBuffer());
  const n = decoded.length;
  const mono = new Float32Array(n);
  for (let c = 0; c < decoded.numberOfChannels; c++) {
    const ch = decoded.getChannelData(c);
    for (let i = 0; i < n; i++) mono[i] += ch[i] / decoded.numberOfChannels;
  }
  const pcm = new DataView(new ArrayBuffer(n * 2));
  for (let i = 0; i < n; i++) pcm.setInt16(2 * i, Math.round(Math.max(-1, Math.min(1, mono[i])) * 32767), true);
  return { wav: new Blob([wavHeader(n, decoded.sampleRate), pcm.buffer], { type: "audio/wav" }),
           seconds: n / decoded.sampleRate };
}

function dataUrl(blob) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(blob);
  });
}

// ------------------------------------------------------------------------------------------------ clips
function setClip(which, clip, origin) {
  const player = $(which + "-audio");
  if (player.src) URL.revokeObjectURL(player.src);
  state[which] = clip && { bytes: clip.wav.size, seconds: clip.seconds, origin, wav: clip.wav };
  if (!clip) {
    player.hidden = true;
    player.removeAttribute("src");
    return;
  }
  player.src = URL.createObjectURL(clip.wav);
  player.hidden = false;
  $(which + "-note").textContent = `${origin}: ${clip.seconds.toFixed(1)} s`;
  if (which === "prompt") document.querySelector("input[name=mode][value=prompt]").checked = true;
}

async function clipFromFile(which, input) {
  const file = input.files && input.files[0];
  if (!file) return;
  $(which + "-note").textContent = "decoding…";
  try {
    setClip(which, await toWav(file), file.name);
  } catch (e) {
    setClip(which, null);
    $(which + "-note").textContent = `${file.name}: the browser cannot decode it (${e.message || e})`;
  }
}

let recording = null;
async function toggleRecord(which) {
  const button = $(which + "-record");
  if (recording) {
    if (recording.which === which) recording.recorder.stop();
    return;
  }
  if (!navigator.mediaDevices || !window.MediaRecorder) {
    $(which + "-note").textContent = "recording needs a secure page (https or localhost) and a microphone";
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (e) {
    $(which + "-note").textContent = `no microphone: ${e.message || e}`;
    return;
  }
  const recorder = new MediaRecorder(stream);
  const parts = [];
  const t0 = performance.now();
  recorder.ondataavailable = (e) => { if (e.data.size) parts.push(e.data); };
  const tick = setInterval(() => {
    state.recordedS = (performance.now() - t0) / 1000;
    button.textContent = `■ Stop (${state.recordedS.toFixed(1)} s)`;
    if (state.recordedS >= MAX_RECORD_S) recorder.stop();
  }, 100);
  recorder.onstop = async () => {
    clearInterval(tick);
    stream.getTracks().forEach((t) => t.stop());
    recording = null;
    state.recording = "";
    button.classList.remove("on");
    button.textContent = "● Record";
    $(which + "-note").textContent = "decoding…";
    try {
      setClip(which, await toWav(new Blob(parts, { type: recorder.mimeType })), "recorded");
    } catch (e) {
      setClip(which, null);
      $(which + "-note").textContent = `the recording could not be decoded: ${e.message || e}`;
    }
  };
  recorder.start(250);
  recording = { which, recorder };
  state.recording = which;
  state.recordedS = 0;
  button.classList.add("on");
  button.textContent = "■ Stop";
}

// ------------------------------------------------------------------------------------------------ playback
// 16-bit little-endian PCM bytes, as they arrive -> AudioBufferSourceNodes scheduled back to back.
class Playback {
  constructor(rate) {
    this.ctx = audioContext();
    this.rate = rate;
    this.next = 0;
    this.parts = [];
    this.samples = 0;
    this.carry = null;
    this.sources = [];
    state.sampleRate = rate;
  }

  push(bytes) {
    if (this.carry) {
      const joined = new Uint8Array(bytes.length + 1);
      joined[0] = this.carry;
      joined.set(bytes, 1);
      bytes = joined;
      this.carry = null;
    }
    if (bytes.length & 1) {
      this.carry = bytes[bytes.length - 1];
      bytes = bytes.subarray(0, bytes.length - 1);
    }
    if (!bytes.length) return;
    const even = bytes.slice(); // own copy: the reader may reuse its buffer
    this.parts.push(even);
    const n = even.length / 2;
    this.samples += n;
    const dv = new DataView(even.buffer);
    const buffer = this.ctx.createBuffer(1, n, this.rate);
    const ch = buffer.getChannelData(0);
    for (let i = 0; i < n; i++) ch[i] = dv.getInt16(2 * i, true) / 32768;
    const src = this.ctx.createBufferSource();
    src.buffer = buffer;
    src.connect(this.ctx.destination);
    const at = Math.max(this.next, this.ctx.currentTime + LEAD_S);
    src.start(at);
    this.next = at + buffer.duration;
    this.sources.push(src);
    state.scheduled += 1;
  }

  stop() {
    for (const s of this.sources) { try { s.stop(); } catch (e) { /* already ended */ } }
  }

  wav() {
    return new Blob([wavHeader(this.samples, this.rate), ...this.parts], { type: "audio/wav" });
  }
}

let current = null; // {abort: AbortController, playback}

function resetOutput(label) {
  Object.assign(state, { runs: state.runs + 1, busy: label, received: 0, chunks: 0, scheduled: 0, sampleRate: 0, done: false, error: "",
                         result: null });
  const link = $("download");
  if (link.href) URL.revokeObjectURL(link.href);
  link.hidden = true;
  link.removeAttribute("href");
  const result = $("result-audio");
  result.hidden = true;
  result.removeAttribute("src");
  $("progress").textContent = "";
}

function progress(p) {
  const s = p ? p.samples / p.rate : 0;
  $("progress").textContent = `received ${kB(state.received)} in ${state.chunks} chunks · ${s.toFixed(2)} s of audio ` +
    `· ${state.scheduled} scheduled`;
}

// Reads ``resp``'s body: a streamed wav (``rate`` null: from its header) or raw PCM at ``rate``.
async function consume(resp, rate, name) {
  const reader = resp.body.getReader();
  let head = rate ? null : new Uint8Array(0);
  let p = rate ? (current.playback = new Playback(rate)) : null;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    let bytes = value;
    if (head) {
      const joined = new Uint8Array(head.length + bytes.length);
      joined.set(head);
      joined.set(bytes, head.length);
      const found = parseWavHeader(joined);
      if (!found) {
        if (joined.length > 65536) throw new Error("wav: no data chunk in the first 64 kB");
        head = joined;
        continue;
      }
      head = null;
      p = current.playback = new Playback(found.rate);
      bytes = joined.subarray(found.offset);
    }
    if (!bytes.length) continue;
    state.received += bytes.length;
    state.chunks += 1;
    p.push(bytes);
    setStatus(`${name}: playing as it arrives…`);
    progress(p);
  }
  if (!p || !p.samples) throw new Error("the answer held no audio");
  const blob = p.wav();
  const url = URL.createObjectURL(blob);
  const seconds = p.samples / p.rate;
  const link = $("download");
  link.href = url;
  link.download = `cosyvoice-${name}-${new Date().toISOString().replace(/[:.]/g, "-")}.wav`;
  link.textContent = `Download WAV (${kB(blob.size)}, ${seconds.toFixed(2)} s)`;
  link.hidden = false;
  const result = $("result-audio");
  result.src = url;
  result.hidden = false;
  state.result = { bytes: blob.size, seconds, sampleRate: p.rate, samples: p.samples };
  progress(p);
}

async function run(name, makeRequest, rate) {
  if (current) return;
  resetOutput(name);
  const ctx = audioContext();
  if (ctx.state !== "running") ctx.resume(); // inside the click: browsers start audio on a user gesture
  current = { abort: new AbortController(), playback: null };
  $("stop").disabled = false;
  for (const id of ["speak", "convert"]) $(id).disabled = true;
  setStatus(`${name}: waiting for the first audio…`);
  try {
    const resp = await makeRequest(current.abort.signal);
    if (!resp.ok) throw await failure(resp);
    const said = Number(resp.headers.get("x-sample-rate"));
    await consume(resp, rate === null ? null : (said > 0 ? said : rate), name);
    state.done = true;
    setStatus(`${name}: done`, "done");
  } catch (e) {
    state.error = e.name === "AbortError" ? "stopped" : (e.message || String(e));
    setStatus(`${name}: ${state.error}`, "error");
    if (current.playback && e.name === "AbortError") current.playback.stop();
  } finally {
    state.busy = "";
    current = null;
    $("stop").disabled = true;
    for (const id of ["speak", "convert"]) $(id).disabled = false;
  }
}

function refuse(text) {
  Object.assign(state, { runs: state.runs + 1, done: false, error: text });
  setStatus(text, "error");
}

// ------------------------------------------------------------------------------------------------ actions
async function speak() {
  const text = $("text").value;
  if (!text.trim()) return refuse("type some text to speak");
  const body = { model: $("model").value.trim() || "cosyvoice2", input: text, response_format: "wav",
                 stream_format: "audio" };
  const mode = document.querySelector("input[name=mode]:checked").value;
  if (mode === "voice") {
    if (!$("voice").value) return refuse("choose a registered voice, or use prompt audio");
    body.voice = $("voice").value;
  } else {
    if (!state.prompt) return refuse("upload or record a prompt first");
    body.reference_audio = await dataUrl(state.prompt.wav);
    const said = $("prompt-text").value.trim();
    if (said) body.reference_text = said;
  }
  const instructions = $("instructions").value.trim();
  if (instructions) body.instructions = instructions;
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  await run("speech", (signal) => fetch(SPEECH_PATH, {
    method: "POST", headers: authHeaders({ "content-type": "application/json" }), body: JSON.stringify(body), signal,
  }), null);
}

async function convert() {
  if (!state.source) return refuse("upload or record the source to convert");
  const form = new FormData();
  form.append("source_wav", state.source.wav, "source.wav");
  const mode = document.querySelector("input[name=mode]:checked").value;
  if (mode === "voice") {
    if (!$("voice").value) return refuse("choose the voice to convert to, or use prompt audio");
    form.append("spk_id", $("voice").value);
  } else {
    if (!state.prompt) return refuse("upload or record the prompt audio (the voice to convert to) first");
    form.append("prompt_wav", state.prompt.wav, "prompt.wav");
  }
  await run("conversion", (signal) => fetch(VC_PATH, { method: "POST", headers: authHeaders(), body: form, signal }),
            VC_RATE);
}

function init() {
  $("refresh").addEventListener("click", loadVoices);
  $("key").addEventListener("change", loadVoices);
  $("prompt-file").addEventListener("change", (e) => clipFromFile("prompt", e.target));
  $("source-file").addEventListener("change", (e) => clipFromFile("source", e.target));
  $("prompt-record").addEventListener("click", () => toggleRecord("prompt"));
  $("source-record").addEventListener("click", () => toggleRecord("source"));
  $("speak").addEventListener("click", speak);
  $("convert").addEventListener("click", convert);
  $("stop").addEventListener("click", () => { if (current) current.abort.abort(); });
  loadVoices();
}

init();
