"use strict";
// The demo page's server: the model id (session.update needs it), the API key, and whether the server can take a
// transcription now. A classic script loaded after messages.js and before app.js, whose `ui`, `session`, `setStatus`
// and `setRunning` it uses once the page has loaded (app.js calls connectServer at start-up).
//
// The page asks /v1/models at load and whenever the server comes back; while it is Ready and idle it asks /health (no
// key: it counts against no per-key limit, serving/limits.py) every HEALTH_MS, so a server that went away is noticed
// before the user presses Start. A server that cannot be reached, or a reverse proxy that answers for it (502, 504,
// a 503 that is not this server's), is asked again every 2 s for the first few tries, as a restart takes, then less
// often, up to twice a minute, for as long as the page stays open; the page becomes Ready again by itself.

const KEY_STORAGE = "jaxstream-api-key"; // sessionStorage: the key lives as long as the tab
const RETRY_MS = 2000;
const RETRY_MAX_MS = 30000;
const RETRY_FAST_TRIES = 5;
// /health is a dictionary read on the server: every 5 s from an idle page costs it nothing, and a restart shows
// within seconds (Kyutai's unmute client polls its health every 5 s too).
const HEALTH_MS = 5000;
// A server that takes the connection but never answers (stopped, or its loop blocked) counts as unreachable after this.
const ASK_TIMEOUT_MS = 10000;

let apiKey = sessionStorage.getItem(KEY_STORAGE) || "";
let modelId = null;
let checkTimer = null; // the next question to the server: one at a time
let failedTries = 0; // questions in a row that found the server unavailable
// The status line says that the server, Ready before, is unavailable: the page connects again when it answers.
let serverDown = false;

// The answer to `path`, or why the server cannot take a transcription ({text, kind, loading}): the request did not
// reach it (refused, reset, timed out: fetch rejects), a reverse proxy answered for it, or the server says so itself
// (its 503s are JSON: /v1/models' {"error": {"code": "not_ready"}}, /health's {"status": "loading"}, "draining", …).
async function ask(path, withKey) {
  let response;
  try {
    response = await fetch(path, { headers: withKey && apiKey ? { Authorization: `Bearer ${apiKey}` } : {},
      cache: "no-store", signal: AbortSignal.timeout(ASK_TIMEOUT_MS) });
  } catch (err) {
    return { text: UNREACHABLE_TEXT, kind: "error" };
  }
  if (![502, 503, 504].includes(response.status)) return response;
  const body = await response.json().catch(() => null); // a proxy's answer is an HTML page
  const state = body && (body.status || (body.error && body.error.code));
  if (state === "not_ready" || state === "loading") return { text: LOADING_TEXT, kind: "busy", loading: true };
  return { text: HEALTH_TEXT[state] || proxyText(response.status), kind: "error" };
}

function scheduleCheck(check, delayMs) {
  clearTimeout(checkTimer);
  checkTimer = setTimeout(check, delayMs);
}

// Asks again later (`check`) and returns the status line for `problem`: every RETRY_MS while the model loads (the
// server answers, and says it is coming), else backing off from RETRY_MS to RETRY_MAX_MS.
function retryLater(problem, check) {
  const delayMs = problem.loading ? RETRY_MS
    : Math.min(RETRY_MAX_MS, RETRY_MS * 2 ** Math.max(0, failedTries - RETRY_FAST_TRIES));
  failedTries = problem.loading ? 0 : failedTries + 1;
  scheduleCheck(check, delayMs);
  return `${problem.text} Trying again in ${delayMs / 1000} s…`;
}

// The server, Ready before, cannot take a transcription (`problem`): the status line, and /health until it answers.
function serverLost(problem) {
  serverDown = true;
  return retryLater(problem, watchServer);
}

// A transcription's socket was set up: the server is there, whatever the status line said before.
function serverAnswered() {
  serverDown = false;
  failedTries = 0;
}

// Status lines from the checks in the background: a running transcription's own status comes first.
function showIdle(text, kind = "info") {
  if (session === null) setStatus(text, kind);
}

const retryAfterSeconds = (response) => Math.max(1, Number(response.headers.get("Retry-After")) || RETRY_MS / 1000);
const keyOwner = () => (apiKey ? "this API key" : "this address");

async function connectServer() {
  clearTimeout(checkTimer); // a key submitted meanwhile connects now
  const response = await ask("/v1/models", true);
  if (!(response instanceof Response)) {
    showIdle(retryLater(response, connectServer), response.kind);
    return;
  }
  if (response.status === 401) {
    askForKey(apiKey ? KEY_REFUSED : KEY_NEEDED);
    return;
  }
  if (response.status === 429) { // the key's requests per minute: the server says when one is allowed again
    const seconds = retryAfterSeconds(response);
    showIdle(`${requestLimitText(keyOwner())} Trying again in ${seconds} s…`, "busy");
    scheduleCheck(connectServer, seconds * 1000);
    return;
  }
  if (!response.ok) {
    showIdle(`The server answered ${response.status} to /v1/models.`, "error");
    return;
  }
  serverAnswered();
  modelId = (await response.json()).data[0].id;
  ui.model.textContent = `model ${modelId}`;
  ui.keyPanel.hidden = true;
  if (session === null) { // a Start pressed while the server was down may be running already
    setRunning(false);
    setStatus(READY_TEXT);
  }
  scheduleCheck(watchServer, HEALTH_MS);
}

// Once Ready: /health every HEALTH_MS while the page is idle and shown (a running transcription's socket tells when
// the server goes; a hidden tab is checked when it is shown again), and with backoff while the server is down.
async function watchServer() {
  if (modelId === null) return; // the key panel, or connectServer's own retries, own the questions
  if (session !== null || document.hidden) {
    if (!document.hidden) scheduleCheck(watchServer, HEALTH_MS);
    return;
  }
  const answer = await ask("/health", false);
  if (modelId === null) return; // the key was refused meanwhile
  if (session !== null) {
    scheduleCheck(watchServer, HEALTH_MS);
  } else if (!(answer instanceof Response)) {
    setStatus(serverLost(answer), answer.kind);
  } else if (serverDown) {
    connectServer(); // the model and the key again: the server may have restarted with others
  } else {
    scheduleCheck(watchServer, HEALTH_MS);
  }
}

document.addEventListener("visibilitychange", () => {
  if (!document.hidden) watchServer();
});

// A browser hides why a handshake failed (a refused key is a 401 before the upgrade, a key over its limits a 429, a
// server that is gone refuses the TCP connection); /v1/models tells most of it. Returns [the status line, its kind],
// or null when the key was the reason: the key panel then asks for another.
async function handshakeFailure() {
  const response = await ask("/v1/models", true);
  if (!(response instanceof Response)) return [serverLost(response), response.kind];
  if (response.status === 401) {
    askForKey(apiKey ? KEY_REFUSED : KEY_NEEDED);
    return null;
  }
  if (response.status === 429) {
    return [`${requestLimitText(keyOwner())} Try again in ${retryAfterSeconds(response)} s.`, "busy"];
  }
  // The server answers and takes the key: what it refuses before the upgrade is the key's (or the address's) open
  // streams, over max_streams_per_key (a 429 that /v1/models, no stream, does not get).
  return [streamLimitText(keyOwner()), "busy"];
}

// When the server cannot be reached, the status line (and the page watches for it to come back); else null.
async function unavailableText() {
  const response = await ask("/v1/models", true);
  return response instanceof Response ? null : serverLost(response);
}

function askForKey(message) {
  clearTimeout(checkTimer);
  modelId = null;
  setRunning(false);
  ui.keyPanel.hidden = false;
  ui.keyMessage.textContent = message;
  ui.model.textContent = "API key needed";
  setStatus(message, "error");
  ui.key.focus();
}

function useKey(key) {
  apiKey = key;
  sessionStorage.setItem(KEY_STORAGE, apiKey);
  connectServer();
}
