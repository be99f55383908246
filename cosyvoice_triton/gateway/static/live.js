// The listening page's live sessions (docs/live.md, "Over WebSocket"), in the registered voice chosen above:
// "talk and hear" sends the microphone as float32 frames over /v1/audio/voice-conversion/live, "type and hear" sends
// the text as it is typed over /v1/audio/speech/live; both play the float32 24 kHz chunks as they arrive.
// window.__live records what was sent and received (for tests); it uses $, audioContext and LEAD_S of listen.js.
"use strict";

const LIVE_PATHS = { talk: "/v1/audio/voice-conversion/live", type: "/v1/audio/speech/live" };
const CAPTURE_FRAMES = 2048; // samples per microphone callback: ~43 ms at 48 kHz

const live = window.__live = { mode: "", running: false, done: false, error: "", rate: 0, sent: [], sentAt: [],
                               received: [], receivedAt: [], latencies: [], firstAudioMs: null, endedAt: null };
// {ws, mode, next (play-out time), capture: {ctx, stream}, sentS, sentEnds: [[seconds, ms]], started, ended}
let session = null;

function liveStatus(text, kind) {
  const el = $("live-status");
  el.textContent = text;
  el.className = kind || "";
}

function liveButtons() {
  const on = live.running;
  $("talk").disabled = $("type").disabled = on;
  $("talk-stop").disabled = !(on && live.mode === "talk");
  $("type-end").disabled = $("live-text").disabled = !(on && live.mode === "type");
}

// Opens a session: the key as the subprotocol bearer.<key> (a browser cannot set headers on a WebSocket).
function openLive(mode, start) {
  if (session) return null;
  const voice = $("voice").value;
  if (!voice) {
    liveStatus("choose a registered voice above (Refresh lists them)", "error");
    return null;
  }
  Object.assign(live, { mode, running: true, done: false, error: "", rate: start.sample_rate || 0, sent: [],
                        sentAt: [], received: [], receivedAt: [], latencies: [], firstAudioMs: null, endedAt: null });
  const key = $("key").value.trim();
  const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + LIVE_PATHS[mode];
  const ws = new WebSocket(url, key ? ["cosyvoice.live", "bearer." + key] : []);
  ws.binaryType = "arraybuffer";
  const play = audioContext();
  if (play.state !== "running") play.resume(); // inside the click: browsers start audio on a user gesture
  session = { ws, mode, next: 0, capture: null, sentS: 0, sentEnds: [], started: false, ended: false };
  const body = { type: "session.start", voice, output_format: "f32le", ...start };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  ws.onopen = () => ws.send(JSON.stringify(body));
  ws.onmessage = (e) => (typeof e.data === "string" ? liveEvent(JSON.parse(e.data)) : liveAudio(e.data));
  ws.onclose = (e) => liveClosed(e);
  liveStatus(`${mode === "talk" ? "talk and hear" : "type and hear"}: connecting…`);
  liveButtons();
  return session;
}

function liveEvent(event) {
  if (event.type === "session.started") {
    session.started = true;
    liveStatus(session.mode === "talk" ? "talk: listening to the microphone…" : "type: each word is spoken as you " +
               "finish it");
    if (session.mode === "talk") startCapture();
  } else if (event.type === "speech.audio.done") {
    live.done = true;
  } else if (event.type === "error") {
    const err = event.error || {};
    live.error = `${err.code || "error"}: ${err.message || "the gateway refused the session"}`;
  }
}

// One chunk of float32 mono at 24 kHz: scheduled right after the one before (a small play-out queue).
function liveAudio(buffer) {
  const now = performance.now();
  const samples = new Float32Array(buffer);
  live.received.push(new Uint8Array(buffer));
  live.receivedAt.push(now);
  if (live.firstAudioMs === null && live.sentAt.length) live.firstAudioMs = now - live.sentAt[0];
  if (session.mode === "talk") {
    // the frame that completed this chunk: the first whose source reaches the audio received so far
    const heard = live.received.reduce((n, b) => n + b.length / 4, 0) / 24000;
    const done = session.sentEnds.find(([seconds]) => seconds >= heard) || session.sentEnds[session.sentEnds.length - 1];
    if (done) live.latencies.push(now - done[1]);
  }
  if (!samples.length) return;
  const ctx = audioContext();
  const chunk = ctx.createBuffer(1, samples.length, 24000);
  chunk.getChannelData(0).set(samples);
  const src = ctx.createBufferSource();
  src.buffer = chunk;
  src.connect(ctx.destination);
  const at = Math.max(session.next, ctx.currentTime + LEAD_S);
  src.start(at);
  session.next = at + chunk.duration;
  liveProgress();
}

function liveProgress() {
  const ms = (x) => (x === null || x === undefined ? "–" : `${Math.round(x)} ms`);
  const sorted = [...live.latencies].sort((a, b) => a - b);
  const audio = live.received.reduce((n, b) => n + b.length / 4, 0) / 24000;
  let text = `${live.received.length} chunks, ${audio.toFixed(2)} s of audio · first audio ${ms(live.firstAudioMs)}`;
  if (sorted.length) {
    text += ` · latency: last ${ms(live.latencies[live.latencies.length - 1])}, median ` +
            `${ms(sorted[Math.floor(sorted.length / 2)])} (chunk after the frame that completed it)`;
  }
  $("live-latency").textContent = text;
}

function liveSend(piece) {
  if (!session || session.ended || session.ws.readyState !== WebSocket.OPEN) return; // nothing after input.end
  const now = performance.now();
  if (typeof piece === "string") {
    if (!piece) return;
    session.ws.send(JSON.stringify({ type: "input.text", text: piece }));
  } else {
    session.ws.send(piece);
    session.sentS += piece.length / live.rate;
    session.sentEnds.push([session.sentS, now]);
  }
  live.sent.push(piece);
  live.sentAt.push(now);
}

function liveEnd() {
  if (!session || session.ended) return;
  stopCapture();
  if (session.mode === "type") sendTyped(true);
  if (session.ws.readyState === WebSocket.OPEN) session.ws.send(JSON.stringify({ type: "input.end" }));
  session.ended = true; // a microphone callback already queued sends nothing more
  live.endedAt = performance.now();
  $("talk-stop").disabled = $("type-end").disabled = true;
  liveStatus("ended: the rest of the audio is on its way…");
}

function liveClosed(e) {
  stopCapture();
  if (!live.error && !live.done) {
    live.error = e.code === 1006 ? "the connection failed (is the gateway reachable?)" : `closed (${e.code})`;
  }
  live.running = false;
  session = null;
  liveButtons();
  liveProgress();
  if (live.error) liveStatus(live.error, "error");
  else liveStatus(`done: ${live.received.length} chunks`, "done");
}

// ------------------------------------------------------------------------------------------------ talk and hear
async function startCapture() {
  const s = session;
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true } });
    if (s !== session || !s.capture) return stream.getTracks().forEach((t) => t.stop()); // ended meanwhile
    s.capture.stream = stream;
    const ctx = s.capture.ctx;
    const proc = ctx.createScriptProcessor(CAPTURE_FRAMES, 1, 1);
    proc.onaudioprocess = (e) => liveSend(new Float32Array(e.inputBuffer.getChannelData(0)));
    ctx.createMediaStreamSource(stream).connect(proc);
    proc.connect(ctx.destination); // its output is silence; connected so that it runs
  } catch (e) {
    live.error = `no microphone: ${e.message || e}`;
    liveStatus(live.error, "error");
    if (s.ws.readyState === WebSocket.OPEN) s.ws.close(1000);
  }
}

function stopCapture(s = session) {
  if (!s || !s.capture) return;
  if (s.capture.stream) s.capture.stream.getTracks().forEach((t) => t.stop());
  s.capture.ctx.close();
  s.capture = null;
}

function talk() {
  // made inside the click (browsers start audio on a user gesture), at the device's own rate: the frames' rate
  const ctx = new AudioContext();
  if (!openLive("talk", { sample_rate: ctx.sampleRate, sample_format: "f32le" })) return ctx.close();
  session.capture = { ctx, stream: null };
}

// ------------------------------------------------------------------------------------------------ type and hear
let typedUpTo = 0; // how much of #live-text has been sent

// Sends what was typed since the last piece: up to the last space (whole words), a paste whole, all of it at the end.
function sendTyped(all, pasted) {
  const text = $("live-text").value;
  typedUpTo = Math.min(typedUpTo, text.length); // deleted text was already spoken
  const rest = text.slice(typedUpTo);
  const cut = all || pasted ? rest.length : rest.search(/\s\S*$/) + 1;
  if (cut <= 0) return;
  liveSend(rest.slice(0, cut));
  typedUpTo += cut;
}

function type() {
  if (!openLive("type", {})) return;
  typedUpTo = $("live-text").value.length; // what was there before is not this session's
  $("live-text").focus();
}

function initLive() {
  $("talk").addEventListener("click", talk);
  $("talk-stop").addEventListener("click", liveEnd);
  $("type").addEventListener("click", type);
  $("type-end").addEventListener("click", liveEnd);
  $("live-text").addEventListener("input", (e) => {
    if (session && session.mode === "type" && session.started) sendTyped(false, e.inputType === "insertFromPaste");
  });
  liveButtons();
}

initLive();
