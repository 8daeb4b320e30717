"use strict";
// The demo page's words (app.js shows them): every sentence for an error, a refusal or an ending, in words a user can
// act on. A classic script loaded before app.js: its constants are app.js's globals.

const MAX_DURATION_TEXT = "The connection reached the server's maximum duration."; // its error code and close code
const SHUTTING_DOWN_TEXT = "The server is shutting down."; // a 1001 close, /health's "draining"
// Codes that answer events this page never sends as it is: the page and the server disagree, most likely because the
// server was upgraded under an open page (or a proxy changed the frames).
const MISMATCH_TEXT = "The server did not accept what this page sent: reload the page (the server may have been " +
  "upgraded since the page was loaded).";
// Every error code the server sends on /v1/realtime (error events, or the close that follows a refusal), in words a
// user can act on. tests/test_demo_page.py finds the codes in the server's source and checks that each is here; a
// code this page does not know (a newer server's) shows as `Server error <code>: <the server's message>`.
const ERROR_TEXT = {
  // The server: busy, loading, shutting down, failing.
  capacity: "The server is busy: every transcription slot is in use. Try again in a moment.",
  backlog: "The server fell too far behind the audio and stopped this transcription. Try again in a moment.",
  not_ready: "The model is still loading. Try again in a moment.",
  draining: "The server is shutting down and takes no new transcription.",
  // Sent by a draining server that ended the utterance's audio itself, before its transcription.done.
  server_draining: "The server is shutting down, so it stopped taking audio: the transcript covers only what " +
    "was said until then.",
  server_shutdown: "The server shut down before the transcription finished: the transcript keeps the text that came.",
  engine_dead: "The server's engine has stopped; it needs a restart.",
  engine_error: "The server's engine failed on this transcription. Try again; the server's log says why.",
  processing_error: "The server failed on this transcription. Try again; the server's log says why.",
  session_closed: "The server ended this transcription before it was complete.",
  // The connection's limits.
  idle_timeout: "The connection was idle for too long and was closed.",
  max_duration_exceeded: MAX_DURATION_TEXT,
  audio_limit_exceeded: "This utterance reached the server's limit on audio per connection: the transcript covers " +
    "the audio until then. Press Start to go on.",
  too_many_errors: "The server closed the connection after too many errors.",
  // What the page sent.
  invalid_request: "The server refused this transcription's settings: choose another delay, or the server default.",
  invalid_audio: "The server could not use the audio this page sent.",
  model_not_found: "The server now serves another model: reload the page.",
  unsupported_model: "This server serves a text language model, not speech-to-text: the microphone demo needs a " +
    "speech model (start the server with one).",
  invalid_frame: MISMATCH_TEXT, invalid_json: MISMATCH_TEXT, invalid_event: MISMATCH_TEXT,
  unknown_event: MISMATCH_TEXT, model_not_validated: MISMATCH_TEXT, generation_in_progress: MISMATCH_TEXT,
  no_active_generation: MISMATCH_TEXT, input_audio_buffer_commit_empty: MISMATCH_TEXT,
};
const KEY_NEEDED = "This server needs an API key: enter it to start.";
const KEY_REFUSED = "The server refused this API key.";
const NETWORK_TEXT = "The network could not keep up with the microphone, so listening stopped: the transcript " +
  "covers the audio sent until then.";
const UNREACHABLE_TEXT = "The server cannot be reached.";
const READY_TEXT = "Ready: press Start and speak, or drop an audio file.";
const LOADING_TEXT = "The model is still loading.";
// A reverse proxy's 502, 504 or 503 (nginx's while the server behind it restarts).
const proxyText = (status) => `The server is unavailable: the proxy in front of it answered ${status} (the server ` +
  "may be restarting).";
// /health's words for a server that answers but cannot take a transcription (its status: serving/app.py).
const HEALTH_TEXT = {
  draining: SHUTTING_DOWN_TEXT, engine_dead: ERROR_TEXT.engine_dead,
  failed: "The server could not load its model; it needs a restart.",
};
// The per-key limits (serving/limits.py; `owner`: "this API key", or "this address" on a server without keys): a 429
// before the WebSocket upgrade, which a browser only reports as a failed handshake.
const requestLimitText = (owner) => `The server has had as many requests from ${owner} as it takes in a minute.`;
const streamLimitText = (owner) => "The server turned the connection down: it is at its limit of open " +
  `transcriptions for ${owner} (other tabs or programs using it count too), or busy. Try again shortly.`;
// Stop before the microphone's first 80 ms (or a file's first chunk) came: nothing to transcribe, nothing wrong.
const NO_AUDIO_TEXT = "No audio was captured, so there is nothing to transcribe.";
// Browsers' autoplay rule: a page's audio plays only once the page has had a click or a key press. A file dropped
// on a fresh page streams all the same (ensureAudio); only the listener's copy is silent.
const SILENT_PLAYBACK_TEXT = "Its playback stays silent until the page has been clicked (a browser rule); the " +
  "transcript is unaffected.";
const FINISHING_TEXT = "Finishing the transcript… (press Stop to end without waiting for it)";
const FINAL_STOPPED_TEXT = "Stopped before the server finished the transcript: its last words may be missing.";
const CLOSE_TEXT = {
  1001: SHUTTING_DOWN_TEXT, 1013: ERROR_TEXT.not_ready, 4000: ERROR_TEXT.idle_timeout,
  4002: ERROR_TEXT.capacity, 4003: MAX_DURATION_TEXT,
  // No close frame: the server died or the network dropped (the transcript keeps the text that came).
  1006: "The connection to the server was lost before the transcript was complete.",
  // Policy violation. This server sends it without an error event when the page did not take its events for
  // send_timeout_s (a stalled tab or network); a proxy may send it for a key or a message it does not allow.
  1008: "The server closed the connection as a policy violation (something it does not allow, such as a page that " +
    "stopped reading its messages). Press Start to try again.",
  // Internal error: without an error event first (which has its own words), the server failed on its side.
  1011: "The server closed the connection after an internal error. Try again; the server's log says why.",
};
// A close's words. The generic ones (1008, 1011, and codes this page has no words for) add the server's reason,
// which says what happened ("client did not read for 30 s").
function closeText(close) {
  const said = close.reason ? ` The server said: “${close.reason}”.` : "";
  if (!(close.code in CLOSE_TEXT)) {
    return `The connection closed before the transcript was complete (close code ${close.code}).${said}`;
  }
  return close.code === 1008 || close.code === 1011 ? CLOSE_TEXT[close.code] + said : CLOSE_TEXT[close.code];
}
const STOPPED_TEXT = "Stopped before any audio was sent.";

function microphoneError(err) {
  switch (err && err.name) {
    case "NotAllowedError":
    case "SecurityError":
      return "Microphone access was denied. Allow the microphone for this site (the icon at the left of " +
        "the address bar) and press Start again.";
    case "NotFoundError":
    case "OverconstrainedError":
      return "No microphone was found. Connect one and press Start again.";
    case "NotReadableError":
      return "The microphone is in use by another application or cannot be opened.";
    default:
      return `The microphone could not be opened: ${err && err.message ? err.message : err}`;
  }
}
