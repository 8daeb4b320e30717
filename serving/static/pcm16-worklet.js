// AudioWorklet processor "pcm16-capture": microphone audio at the context's rate in, 80 ms chunks of
// 16 kHz mono PCM16 out (the /v1/realtime wire format), each posted with its peak level for a meter.
// Shared by the demo page and the Colab notebook, which loads this same file as a Blob module: it stays one
// self-contained file.
const TARGET_RATE = 16000;
const CHUNK = 1280; // 80 ms at 16 kHz: one model step, so every message feeds the engine one slot
// The resampler's low-pass: a Blackman-windowed sinc with 16 zero crossings a side, cut off at 0.9 of the lower
// Nyquist frequency (7.2 kHz going to 16 kHz). Flat to 6 kHz, -3 dB at 7.2 kHz, -75 dB at 9 kHz and below -80 dB
// from 10 kHz on: what lies above 8 kHz no longer folds back into the band (a box filter let 10 kHz through onto
// 6 kHz at -6 dB).
const ZERO_CROSSINGS = 16;
const PASSBAND = 0.9;

function gcd(a, b) {
  while (b) [a, b] = [b, a % b];
  return a;
}

// Resampling by the exact ratio rateOut / rateIn = up / down: output sample n lies at input position
// n * down / up, and is the sum of the input samples around it weighted by the low-pass kernel centred there.
// The positions' fractional parts repeat every `up` outputs, so the weights are computed once, one set
// ("phase") per fractional part: at most 16000 phases (an odd rate), 160 at 44.1 kHz, 1 at 48 kHz.
class Resampler {
  constructor(rateIn, rateOut) {
    rateIn = Math.round(rateIn);
    const divisor = gcd(rateIn, rateOut);
    this.up = rateOut / divisor;
    this.down = rateIn / divisor;
    this.identity = this.up === 1 && this.down === 1;
    // The cutoff, in cycles per input sample, below both Nyquist frequencies: downsampling, nothing above the
    // output's folds back; upsampling, no image of the input's spectrum is left above the input's.
    const cutoff = (PASSBAND * 0.5 * Math.min(rateIn, rateOut)) / rateIn;
    this.radius = Math.ceil(ZERO_CROSSINGS / (2 * cutoff)); // the kernel's half length, in input samples
    const taps = 2 * this.radius;
    this.phases = [];
    for (let phase = 0; phase < this.up; phase++) {
      // Output at input position i + phase/up takes the inputs i - radius + 1 .. i + radius.
      const weights = new Float32Array(taps);
      let sum = 0;
      for (let j = 0; j < taps; j++) {
        const distance = phase / this.up + this.radius - 1 - j;
        const x = 2 * cutoff * distance;
        const sinc = x === 0 ? 1 : Math.sin(Math.PI * x) / (Math.PI * x);
        const w = distance / this.radius; // -1 .. 1 over the kernel
        const blackman = 0.42 + 0.5 * Math.cos(Math.PI * w) + 0.08 * Math.cos(2 * Math.PI * w);
        weights[j] = sinc * blackman;
        sum += weights[j];
      }
      for (let j = 0; j < taps; j++) weights[j] /= sum; // unit gain at 0 Hz for every phase
      this.phases.push(weights);
    }
    // The input not yet consumed, led by radius - 1 zeros so the first output lies on the first input sample.
    this.buffer = new Float32Array(taps + 4096);
    this.length = this.radius - 1;
    this.position = this.radius - 1; // the integer part of the next output's position, in `buffer`
    this.phase = 0; // its fractional part, in 1/up
  }

  // Takes input samples and calls emit(y) for every output sample they complete.
  push(samples, emit) {
    if (this.identity) {
      for (const x of samples) emit(x);
      return;
    }
    if (this.length + samples.length > this.buffer.length) {
      const grown = new Float32Array(2 * (this.length + samples.length));
      grown.set(this.buffer.subarray(0, this.length));
      this.buffer = grown;
    }
    this.buffer.set(samples, this.length);
    this.length += samples.length;
    const taps = 2 * this.radius;
    while (this.position + this.radius < this.length) {
      const weights = this.phases[this.phase];
      const first = this.position - this.radius + 1;
      let y = 0;
      for (let j = 0; j < taps; j++) y += this.buffer[first + j] * weights[j];
      emit(y);
      this.phase += this.down;
      this.position += Math.floor(this.phase / this.up);
      this.phase %= this.up;
    }
    // Keep only what later outputs still need.
    const drop = Math.min(this.position - this.radius + 1, this.length);
    this.buffer.copyWithin(0, drop, this.length);
    this.length -= drop;
    this.position -= drop;
  }
}

class Pcm16Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    // `sampleRate`: the context's rate, whatever the page asked for or the device imposed (44.1 or 48 kHz
    // usually, 8 or 16 kHz on a Bluetooth headset).
    this.resampler = new Resampler(sampleRate, TARGET_RATE);
    this.emit = (x) => this.emitSample(x);
    this.mono = new Float32Array(128);
    this.chunk = new Int16Array(CHUNK);
    this.filled = 0;
    this.peak = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (channels && channels.length > 0) {
      const frames = channels[0].length;
      if (this.mono.length !== frames) this.mono = new Float32Array(frames);
      this.mono.fill(0);
      for (const channel of channels) {
        for (let i = 0; i < frames; i++) this.mono[i] += channel[i] / channels.length;
      }
      this.resampler.push(this.mono, this.emit);
    }
    return true; // keep running while the input is silent or momentarily absent
  }

  emitSample(x) {
    const clipped = Math.max(-1, Math.min(1, x));
    this.peak = Math.max(this.peak, Math.abs(clipped));
    this.chunk[this.filled++] = Math.round(clipped * 32767);
    if (this.filled === CHUNK) {
      // Transfer the buffer (no copy) and start a fresh one.
      this.port.postMessage({ pcm: this.chunk.buffer, peak: this.peak }, [this.chunk.buffer]);
      this.chunk = new Int16Array(CHUNK);
      this.filled = 0;
      this.peak = 0;
    }
  }
}

registerProcessor("pcm16-capture", Pcm16Capture);
