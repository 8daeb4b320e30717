"use strict";
// The demo page: microphone or a dropped file -> 16 kHz PCM16 -> /v1/realtime (vLLM's realtime protocol,
// specs/realtime_protocols.md §1) -> live transcript. One WebSocket per utterance: session.created,
// session.update{model, transcription_delay_ms}, commit{}, appends every 80 ms, commit{final: true}, then
// deltas and one transcription.done; the socket is closed after it, or FINAL_WAIT_MS after the final commit.
// The sentences it shows are in messages.js, loaded first; the server's model id, the API key and whether the
// server can be reached are connection.js's, loaded next.

const SAMPLE_RATE = 16000;
const CHUNK = 1280; // 80 ms: what the worklet posts, and the file streamer's step
// A browser's WebSocket can set no header but Sec-WebSocket-Protocol, so the key travels there, as OpenAI's
// browser clients send theirs: not in the URL, which access logs and proxies keep. The server selects the
// other subprotocol offered (a browser fails a handshake that offered subprotocols and got none back) and
// never echoes the key. A subprotocol is an HTTP token (`TOKEN`): a key with other characters, such as the
// `/` and `=` of `openssl rand -base64 32`, cannot travel this way (the browser throws a SyntaxError), so such
// a key goes in `?api_key=`, as the page sent every key before and the server still accepts (`keyQuery`): a
// key that works, if in the URL, rather than a page that refuses keys servers already use.
const VLLM_SUBPROTOCOL = "vllm-realtime";
const KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key.";
const TOKEN = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;
// Send backpressure: the bytes the socket may hold unsent (bufferedAmount), about 2 s of audio as base64. A
// file waits below it; the microphone, which cannot wait, stops above it (`NETWORK_TEXT`).
const MAX_BUFFERED_BYTES = 2 * SAMPLE_RATE * 2 * (4 / 3);
// After the final commit, how long the page waits for transcription.done before it closes the socket itself. The
// server answers once it has the audio still in the socket (at most the ~2 s of MAX_BUFFERED_BYTES) and has run
// the model over the delay's right padding, faster than real time (0.2-0.3 s at the default delay on the test
// suite's CPU): 5 s covers both with room, and keeps Stop within the few seconds a user waits. Without a bound a
// stalled network, or a server that never answers, left the page "Finishing…" until the server's idle timeout
// (150 s by default).
const FINAL_WAIT_MS = 5000;
const FINAL_LATE_TEXT = `The end of the transcript did not come within ${FINAL_WAIT_MS / 1000} s, so the page ` +
  "stopped waiting: its last words may be missing.";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), keyPanel: $("key-panel"), key: $("api-key"), keyMessage: $("key-message"),
  start: $("start"), stop: $("stop"), delay: $("delay"), level: $("level"), file: $("file"), drop: $("drop"),
  status: $("status"), transcript: $("transcript"),
  statDelay: $("stat-delay"), statFirst: $("stat-first"), statWord: $("stat-word"), statFinal: $("stat-final"),
  statAudio: $("stat-audio"),
};

let audioContext = null;
let captureLoaded = false; // the capture worklet is loaded into audioContext
// The one session at a time, from the click (or chosen file) that starts it to its end:
// {utterance, stop(), stopRequested}; utterance and stop are null until the socket and the audio are ready.
let session = null;

function setStatus(text, kind = "info") {
  ui.status.textContent = text;
  ui.status.className = `status ${kind}`;
}

function setRunning(running) {
  ui.start.disabled = running || modelId === null;
  ui.file.disabled = running || modelId === null;
  ui.delay.disabled = running;
  ui.stop.disabled = !running;
  ui.drop.classList.toggle("disabled", running || modelId === null);
}

ui.keyPanel.addEventListener("submit", (event) => {
  event.preventDefault();
  useKey(ui.key.value.trim());
});

// -- one utterance on one WebSocket -------------------------------------------------------------------
class Utterance {
  constructor(label) {
    this.paragraph = document.createElement("p");
    this.paragraph.className = "partial";
    this.paragraph.dataset.source = label;
    ui.transcript.append(this.paragraph);
    this.text = "";
    this.sent = []; // [samples sent so far, time] per append: when each moment of audio left the page
    this.samples = 0;
    this.textArrivals = []; // [words in the text so far, time] per delta
    this.finalSent = false;
    this.finalAt = null;
    this.finalTimer = null; // gives up on transcription.done FINAL_WAIT_MS after the final commit
    this.warning = null; // shown instead of "Done" when the transcript ends, e.g. NETWORK_TEXT
    this.notice = null; // shown as plain information instead of "Done", e.g. NO_AUDIO_TEXT
    this.ended = false;
    this.onEnded = () => {};
    this.stats = { first: null, word: null, final: null };
    for (const stat of [ui.statFirst, ui.statWord, ui.statFinal, ui.statAudio]) stat.textContent = "–";
  }

  // Resolves once the session is set up and audio may be sent; rejects with a user-readable Error.
  open(delayMs) {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const inHandshake = apiKey && TOKEN.test(apiKey);
    const protocols = inHandshake ? [VLLM_SUBPROTOCOL, KEY_SUBPROTOCOL_PREFIX + apiKey] : [];
    const keyQuery = apiKey && !inHandshake ? `?api_key=${encodeURIComponent(apiKey)}` : "";
    this.ws = new WebSocket(`${scheme}://${location.host}/v1/realtime${keyQuery}`, protocols);
    let opened = false;
    this.ws.onopen = () => { opened = true; };
    ui.statDelay.textContent = delayMs ? `${delayMs} ms` : "server default";
    return new Promise((resolve, reject) => {
      this.ws.onmessage = (message) => {
        const event = JSON.parse(message.data);
        if (event.type === "session.created") {
          serverAnswered();
          const update = { type: "session.update", model: modelId };
          if (delayMs) update.transcription_delay_ms = delayMs;
          this.ws.send(JSON.stringify(update));
          this.ws.send(JSON.stringify({ type: "input_audio_buffer.commit" }));
          resolve();
        } else if (event.type === "error") {
          reject(new Error(ERROR_TEXT[event.code] || `${event.code}: ${event.error}`));
        }
        this.handle(event);
      };
      this.ws.onclose = (close) => {
        // Before session.created a close is a refusal: at capacity, loading (its code says which), or the
        // handshake failed (1006, whatever the reason: handshakeFailure finds it).
        const refusal = new Error(closeText(close));
        refusal.handshakeFailed = !opened;
        reject(refusal);
        this.closed(close);
      };
    });
  }

  handle(event) {
    if (this.ended) return;
    const now = performance.now();
    if (event.type === "session.updated") {
      ui.statDelay.textContent = `${event.session.transcription_delay_ms} ms`;
    } else if (event.type === "transcription.delta") {
      if (this.stats.first === null && this.sent.length) this.stats.first = now - this.sent[0][1];
      this.text += event.delta;
      this.textArrivals.push([countWords(this.text), now]);
      this.paragraph.textContent = this.text;
      this.showStats();
    } else if (event.type === "transcription.done") {
      if (this.finalAt !== null) this.stats.final = now - this.finalAt;
      this.text = event.text;
      this.showFinal(event.words || []);
      this.end(null);
    } else if (event.type === "error") {
      this.end(ERROR_TEXT[event.code] || `Server error ${event.code}: ${event.error}`);
    }
  }

  closed(close) {
    if (!this.ended) {
      this.end(closeText(close));
    }
  }

  // The network has not taken the audio sent so far: more than MAX_BUFFERED_BYTES wait in the socket.
  backlogged() {
    return this.ws.bufferedAmount > MAX_BUFFERED_BYTES;
  }

  send(pcm16) {
    if (this.ended || this.finalSent || this.ws.readyState !== WebSocket.OPEN) return;
    this.ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: base64(pcm16) }));
    this.samples += pcm16.length;
    this.sent.push([this.samples, performance.now()]);
    ui.statAudio.textContent = `${(this.samples / SAMPLE_RATE).toFixed(1)} s`;
  }

  finish() {
    if (this.ended || this.finalSent) return;
    this.finalSent = true;
    if (this.samples === 0) {
      this.notice = NO_AUDIO_TEXT; // Stop came first: no error, the server's utterance is abandoned with the socket
      this.end(null);
      return;
    }
    this.finalAt = performance.now();
    this.ws.send(JSON.stringify({ type: "input_audio_buffer.commit", final: true }));
    setStatus(FINISHING_TEXT);
    this.finalTimer = setTimeout(() => this.giveUp(FINAL_LATE_TEXT), FINAL_WAIT_MS);
  }

  // Ends without transcription.done: the transcript keeps the text that came, and the status says why.
  giveUp(reason) {
    if (this.ended) return;
    this.warning = this.warning ? `${this.warning} ${reason}` : reason;
    this.end(null);
  }

  end(error) {
    clearTimeout(this.finalTimer);
    this.ended = true;
    this.paragraph.classList.remove("partial");
    if (!this.text) this.paragraph.remove();
    if (this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
    this.onEnded(error);
  }

  showFinal(words) {
    this.paragraph.className = "final";
    this.paragraph.textContent = "";
    if (words.length === 0) {
      this.paragraph.textContent = this.text;
    } else {
      for (const word of words) {
        const span = document.createElement("span");
        span.textContent = word.word;
        span.title = `${word.start.toFixed(2)}–${word.end.toFixed(2)} s`;
        this.paragraph.append(span, " ");
      }
      this.stats.word = medianWordLatency(words, this.textArrivals, this.sent);
    }
    this.showStats();
  }

  showStats() {
    const ms = (value) => (value === null ? "–" : `${Math.round(value)} ms`);
    ui.statFirst.textContent = ms(this.stats.first);
    ui.statWord.textContent = ms(this.stats.word);
    ui.statFinal.textContent = ms(this.stats.final);
  }
}

function countWords(text) {
  const trimmed = text.trim();
  return trimmed ? trimmed.split(/\s+/).length : 0;
}

// Word latency as `jaxstream eval` defines it: from the moment the audio at a word's end left the page to
// the arrival of the delta that carried the word. Only meaningful for audio sent at real time.
function medianWordLatency(words, arrivals, sent) {
  const latencies = [];
  words.forEach((word, index) => {
    const arrival = arrivals.find(([count]) => count > index);
    const spoken = sent.find(([samples]) => samples >= word.end * SAMPLE_RATE);
    if (arrival && spoken) latencies.push(arrival[1] - spoken[1]);
  });
  if (latencies.length === 0) return null;
  latencies.sort((a, b) => a - b);
  return latencies[Math.floor(latencies.length / 2)];
}

// PCM16 bytes -> base64. Typed arrays use the platform's byte order, little-endian wherever browsers run,
// which is the wire format.
function base64(pcm16) {
  const bytes = new Uint8Array(pcm16.buffer, pcm16.byteOffset, pcm16.byteLength);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function showLevel(peak) {
  const db = 20 * Math.log10(Math.max(peak, 1e-4)); // -80 dB .. 0 dB
  ui.level.style.width = `${Math.max(0, Math.min(100, ((db + 60) / 60) * 100))}%`;
}

// -- audio: one context for capture and playback, created on first use ------------------------------------
// `capture`: the microphone's worklet is loaded too. Files do without it, so they stream even where the
// browser has no AudioWorklet (pages that are neither https nor localhost). A failure throws an Error in words
// for the status line.
// Autoplay rules let a context run only once the page has had a click or a key press. Start is a click, and the
// microphone needs the context running (its worklet runs only then), so it waits for resume(). A file may come
// before any (dropped on a fresh page): resume() would then wait for ever (its promise settles once resume() is
// called after a click), so a file does not wait: it streams all the same, and its playback, there for the listener
// only, stays silent until the page's first click (streamFile says so, and resumes the context then).
async function ensureAudio(capture) {
  let loading = false; // the failure, if any, is the worklet module's load
  try {
    if (audioContext === null) audioContext = new AudioContext();
    if (capture && !captureLoaded) {
      // Throws at once where the browser has no AudioWorklet (neither https nor localhost): not a load failure.
      const load = audioContext.audioWorklet.addModule("/static/pcm16-worklet.js");
      loading = true;
      await load;
      loading = false;
      captureLoaded = true; // only once loaded: a failed load is tried again on the next Start
    }
    const resumed = audioContext.resume();
    if (capture) await resumed;
  } catch (err) {
    // The module comes from the server: when the server is gone, the browser's words ("Failed to load worklet module
    // script (Network error)") blame the browser. /v1/models tells which.
    const unavailable = loading ? await unavailableText() : null;
    if (unavailable !== null) throw new Error(unavailable);
    throw new Error(`The browser's audio could not be set up: ${err && err.message ? err.message : err}`);
  }
  return audioContext;
}

// Runs work(current) as the session, unless one runs already. The session is taken before anything is
// awaited: a second click, a file dropped meanwhile and Stop see it at once.
async function startSession(work) {
  if (session !== null || modelId === null) return;
  const current = { utterance: null, stop: null, stopRequested: false };
  session = current;
  setRunning(true);
  try {
    await work(current);
  } catch (err) {
    setStatus(err && err.message ? err.message : String(err), "error");
  } finally {
    session = null;
    showLevel(0);
    setRunning(false);
  }
}

async function run(current, label, prepare) {
  // prepare(utterance) starts the audio source and returns its stop function; the utterance sends audio.
  if (current.stopRequested) {
    setStatus(STOPPED_TEXT);
    return;
  }
  const delayMs = Number(ui.delay.value) || null;
  const utterance = new Utterance(label);
  current.utterance = utterance;
  try {
    const ended = new Promise((resolve) => { utterance.onEnded = resolve; });
    setStatus("Connecting…");
    await utterance.open(delayMs);
    if (current.stopRequested) { // Stop while connecting: the audio source never starts
      utterance.end(null);
      setStatus(STOPPED_TEXT);
      return;
    }
    current.stop = await prepare(utterance);
    const error = await ended;
    current.stop();
    if (error) setStatus(error, error === ERROR_TEXT.capacity ? "busy" : "error");
    else if (utterance.warning) setStatus(utterance.warning, "warning");
    else if (utterance.notice) setStatus(utterance.notice);
    else setStatus("Done. Press Start for another utterance, or drop a file.");
  } catch (err) {
    if (!utterance.ended) utterance.end(null);
    const [message, kind] = err.handshakeFailed ? (await handshakeFailure()) || [] : [err.message, "error"];
    if (message) setStatus(message, message === ERROR_TEXT.capacity ? "busy" : kind);
  }
}

ui.start.addEventListener("click", () => startSession(async (current) => {
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    setStatus("This browser only gives the microphone to https:// pages and to localhost. Open the page " +
      "over https, or through an SSH tunnel to localhost.", "error");
    return;
  }
  const context = await ensureAudio(true); // a failure is startSession's to show
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({
      // Raw audio: the model was trained on it; echo cancellation and noise suppression distort speech.
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
    await run(current, "microphone", async (utterance) => {
      const source = context.createMediaStreamSource(stream);
      const worklet = new AudioWorkletNode(context, "pcm16-capture", { channelCount: 1, channelCountMode: "explicit" });
      const mute = context.createGain();
      mute.gain.value = 0; // the destination pulls the graph; nothing is played back
      source.connect(worklet).connect(mute).connect(context.destination);
      const stopCapture = () => {
        worklet.port.onmessage = null;
        source.disconnect();
        worklet.disconnect();
        stream.getTracks().forEach((track) => track.stop());
      };
      worklet.port.onmessage = (message) => {
        if (utterance.backlogged()) {
          // Live audio cannot wait for the network: the transcript would fall further behind for as long as
          // the user speaks, and the socket's buffer grow without bound. Finish with what was sent instead.
          stopCapture();
          showLevel(0);
          utterance.warning = NETWORK_TEXT;
          utterance.finish();
          setStatus(`${NETWORK_TEXT} Finishing…`, "warning");
          return;
        }
        utterance.send(new Int16Array(message.data.pcm));
        showLevel(message.data.peak);
      };
      stream.getAudioTracks()[0].onended = () => utterance.finish(); // microphone unplugged
      setStatus("Listening… press Stop when you are done.", "live");
      return stopCapture;
    });
  } catch (err) {
    setStatus(microphoneError(err), "error");
  } finally {
    if (stream) stream.getTracks().forEach((track) => track.stop());
  }
}));

ui.stop.addEventListener("click", () => {
  if (session === null) return;
  session.stopRequested = true; // honoured once the socket is open, when Stop comes before the audio
  const utterance = session.utterance;
  if (utterance && utterance.finalSent) {
    // Stop while the final transcript is pending (a second press, or after a file's end): the user would rather
    // end now than wait for the last words.
    utterance.giveUp(FINAL_STOPPED_TEXT);
  } else if (session.stop) {
    session.stop();
    utterance.finish();
  }
});

// -- a file, streamed at real time --------------------------------------------------------------------
const streamFile = (file) => startSession(async (current) => {
  const context = await ensureAudio(false); // a failure is startSession's to show
  let decoded;
  try {
    decoded = await context.decodeAudioData(await file.arrayBuffer());
  } catch (err) {
    setStatus(`${file.name}: this browser cannot decode the file as audio.`, "error");
    return;
  }
  // The browser's resampler, offline: mono 16 kHz float.
  const offline = new OfflineAudioContext(1, Math.ceil(decoded.duration * SAMPLE_RATE), SAMPLE_RATE);
  const source = offline.createBufferSource();
  source.buffer = decoded;
  source.connect(offline.destination);
  source.start();
  const pcm = (await offline.startRendering()).getChannelData(0);

  await run(current, file.name, async (utterance) => {
    const player = context.createBufferSource();
    player.buffer = decoded;
    player.connect(context.destination);
    let stopped = false;
    let pausedAt = null; // while the network holds the audio back: when the wait began (the status says so)
    let started = performance.now(); // the file's clock: when its first sample was due to play, less the pauses
    const fileSeconds = () => ((pausedAt === null ? performance.now() : pausedAt) - started) / 1000;
    // Whether the listener hears the file: not before the browser lets the context run (SILENT_PLAYBACK_TEXT).
    let audible = context.state === "running";
    const showStreaming = () => {
      if (stopped || utterance.ended || pausedAt !== null) return;
      const streaming = `Streaming ${file.name} (${decoded.duration.toFixed(1)} s) at real time…`;
      setStatus(audible ? streaming : `${streaming} ${SILENT_PLAYBACK_TEXT}`, "live");
    };
    if (audible) {
      player.start();
    } else {
      // The context may run once the page has had a click or a key press, but it runs only when resume() is
      // called after that (Chromium settles a resume() from before then, not at the click): each click or key
      // press calls it until the context runs (Escape, say, is no activation).
      const gestures = ["click", "keydown"];
      const resumeOnGesture = () => context.resume();
      gestures.forEach((type) => window.addEventListener(type, resumeOnGesture, true));
      // The playback then starts where the file's clock is, in step with what was sent, not at the file's
      // beginning, behind it.
      context.resume().then(() => {
        gestures.forEach((type) => window.removeEventListener(type, resumeOnGesture, true));
        audible = true;
        if (stopped || utterance.ended || fileSeconds() >= decoded.duration) return;
        player.start(0, fileSeconds());
        if (pausedAt !== null) context.suspend(); // the click came while the network holds the audio back
        showStreaming();
      });
    }
    showStreaming();
    (async () => {
      for (let begin = 0; begin < pcm.length && !stopped; begin += CHUNK) {
        const end = Math.min(begin + CHUNK, pcm.length);
        // Each chunk leaves once its last sample has been "spoken", as from a microphone.
        const wait = started + (end / SAMPLE_RATE) * 1000 - performance.now();
        if (wait > 0) await sleep(wait);
        if (utterance.backlogged()) {
          // A file can wait for a slow network (polled: a WebSocket has no drain event). Its playback waits
          // too, as a media player's does while it buffers, and the file's clock stops: what the user hears
          // stays what the server has got, and the audio goes on at real time, as it played, afterwards.
          // Suspending the context pauses the player in place (nothing else plays in a file's session).
          pausedAt = performance.now();
          context.suspend();
          setStatus(`Waiting for the network to take the audio sent so far (${file.name})…`, "warning");
          while (utterance.backlogged() && !stopped && !utterance.ended) await sleep(50);
          context.resume(); // not awaited: see ensureAudio
          started += performance.now() - pausedAt;
          pausedAt = null;
          showStreaming();
        }
        if (stopped) break;
        const chunk = new Int16Array(end - begin);
        let peak = 0;
        for (let i = begin; i < end; i++) {
          const x = Math.max(-1, Math.min(1, pcm[i]));
          peak = Math.max(peak, Math.abs(x));
          chunk[i - begin] = Math.round(x * 32767);
        }
        utterance.send(chunk);
        showLevel(peak);
      }
      showLevel(0);
      utterance.finish();
    })();
    return () => {
      stopped = true;
      try { player.stop(); } catch (err) { /* already ended */ }
    };
  });
});

ui.file.addEventListener("change", () => {
  if (ui.file.files.length) streamFile(ui.file.files[0]);
  ui.file.value = ""; // the same file may be chosen again
});
ui.drop.addEventListener("dragover", (event) => {
  event.preventDefault();
  ui.drop.classList.add("over");
});
ui.drop.addEventListener("dragleave", () => ui.drop.classList.remove("over"));
ui.drop.addEventListener("drop", (event) => {
  event.preventDefault();
  ui.drop.classList.remove("over");
  if (event.dataTransfer.files.length) streamFile(event.dataTransfer.files[0]);
});

// -- start-up -----------------------------------------------------------------------------------------
for (const ms of ui.delay.dataset.delays.split(",").filter(Boolean)) {
  ui.delay.append(new Option(`${ms} ms`, ms));
}
ui.key.value = apiKey;
setRunning(false);
connectServer();
